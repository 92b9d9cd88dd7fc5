"""batchgen: offline batch LLM generation from Parquet to Parquet."""

__version__ = "0.1.0"
