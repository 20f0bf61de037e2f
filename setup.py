"""The one compiled part: --deep's value test and layout match in C (cachedoctor/formats/
_native.c). It is optional: where it cannot be built (no compiler), the install still
succeeds and the same checks run in Python. Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("cachedoctor.formats._native", ["cachedoctor/formats/_native.c"],
                             optional=True, extra_compile_args=["-O3"])])
