"""kvzip's version (pyproject.toml's, kept equal to it by tests/test_install.py)."""
__version__ = "0.1.0"
