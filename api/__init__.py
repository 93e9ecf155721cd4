"""loraserve: serve LoRA-adapted text classifiers."""

__version__ = "0.1.0"
