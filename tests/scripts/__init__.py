"""scripts/: the training data loaders and how the spam adapters are scored."""
