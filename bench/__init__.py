"""Benchmarks for shoal."""
