"""dpserve's benchmarks, one package per subject; run each from the repository root as
``python -m benchmarks.<folder>.<name>`` (README.md beside this file lists them)."""
