"""Offline scripts: data preparation and training of the embedded default adapters."""
