"""Helpers for tests and benchmarks: synthetic model files (:mod:`.synthetic`)."""
