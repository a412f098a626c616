"""Helpers shipped for tests and benchmarks (importable by child processes)."""
