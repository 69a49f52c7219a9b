"""edgerun's version: one constant, importable by any module without importing the package's public API."""

__version__ = "0.1.0"
