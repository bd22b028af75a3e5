"""Benchmarks: programs that print and save figures, each a ratio to a reference in the same run."""
