"""The package's version: one place that the build and a run from a checkout both read."""

__version__ = "0.2.0"
