"""Bundles (DESIGN.md §7): one call of a model captured, compiled for target delegates, and saved
to run without the model's Python code. build → save → load."""
from torchnative.bundle.format import BundleError
from torchnative.bundle.load import Bundle, load

__all__ = ["Bundle", "BundleError", "load"]
