"""dpserve: serve a language model data-parallel on vLLM replicas, and keep it fresh."""

__version__ = "0.1.0"
