"""api.models: loading, quantizing, packing, converting, tokenizing and the model kinds."""
