"""Prefect flows: the thin layer that turns validated parameters into library calls."""
