"""Benchmarks are programs, not tests: they print measurements, ratios and run conditions."""
