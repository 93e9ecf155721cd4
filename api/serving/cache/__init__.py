"""The result cache: tiers in order (the in-process LRU, the disk, Redis shared by every
replica), each behind one interface (tier.Tier), asked in turn by ResultCache."""

from api.serving.cache.entry import Entry, cache_key
from api.serving.cache.tiers import Lookup, ResultCache

__all__ = ["Entry", "Lookup", "ResultCache", "cache_key"]
