"""``python -m dpserve.demo_data``: regenerate the shipped dataset files."""

from pathlib import Path

from dpserve.demo_data import write

write(Path(__file__).parent)
