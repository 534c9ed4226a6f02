"""The package version, readable without importing TensorFlow."""

__version__ = "0.3.1"
