"""Tensile: TENSILE tensor-granularity GPU memory scheduling for many PyTorch jobs on one GPU."""

__version__ = "0.1.0"
