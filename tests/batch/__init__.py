"""api.batch: `loraserve score` and `evaluate`, run as a user runs them."""
