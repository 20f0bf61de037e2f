"""The reference encode/train harness: each incident of docs/incidents.md reproduced
by its real mechanism on real ranks, named by `cachedoctor scan`, and its fix verified.

`cachedoctor harness list|reproduce|verify`; the parts: project.py (SimpleTuner project files),
launcher.py and rank.py (the process group), encoders.py, writers.py, data.py, training.py and
pipeline.py (the reference pipeline), scenarios/ (one module per incident), runner.py.
"""
