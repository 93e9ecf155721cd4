"""Benchmarks: each writes its report into bench/reports/."""
