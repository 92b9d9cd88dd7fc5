"""Parquet in, Parquet out: reading and validating prompts, the run directory, the writer."""
