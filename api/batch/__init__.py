"""Files scored in bulk: `loraserve score` and `loraserve evaluate`."""
