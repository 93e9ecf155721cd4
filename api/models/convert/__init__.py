"""Checkpoints converted once into the layout transformers loads natively."""
