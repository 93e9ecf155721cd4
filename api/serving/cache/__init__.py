"""The result cache: tiers in order (an in-process LRU, then disk), behind ResultCache."""

from api.serving.cache.entry import Entry, cache_key
from api.serving.cache.tiers import Lookup, ResultCache

__all__ = ["Entry", "Lookup", "ResultCache", "cache_key"]
