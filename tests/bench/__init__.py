"""bench/: the benchmarks' own code, and their quick and smoke forms."""
