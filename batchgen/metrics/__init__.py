"""Clocks, run conditions and the device probe."""
