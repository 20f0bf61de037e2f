"""cachedoctor: find and repair broken training caches of diffusion trainers."""

__version__ = "0.1.0"
