"""api.serving: batching and its plan, admission, the cache tiers, the cascade, adapters."""
