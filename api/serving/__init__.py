"""What happens to texts, knowing no HTTP: cache tiers, the batcher, the cascade."""
