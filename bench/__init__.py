"""Benchmarks: each module measures and prints; none passes or fails on time."""
