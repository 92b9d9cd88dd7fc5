"""DuckDB reports over run directories: SQL lives in sql/, this package only runs it."""
