"""The report queries, one per file; installed inside the package as batchgen.sql (see pyproject.toml)."""
