"""Benchmarks: the bench prompt set, CPU/GPU timing of plain and speculative decoding, peer comparisons."""
