"""Prefix-aware admission on the real path: the order benchmark (batchgen.benchmarks.prefix) at a small
size on the tiny model. The scheduler's own rules are tested alone in test_block_manager."""


def test_the_prefix_order_benchmark_runs_at_a_small_size(tiny_model_dir, capsys):
    """`python -m batchgen.benchmarks.prefix` (320 rows by default) at 24 rows on the tiny model: the
    three variants, ratios and conditions printed; random order with prefix admission computes fewer
    prompt tokens than with first-come admission (exact counts, not speed)."""
    from batchgen.benchmarks import prefix

    prefix.main(["--rows", "24", "--shard-size", "12", "--max-num-seqs", "4", "--kv-cache-tokens", "640",
                 "--new-tokens", "2", "--repeats", "1", "--model", str(tiny_model_dir)])
    out = capsys.readouterr().out
    assert "conditions: 24 rows, 8 system prompts" in out and "targets:" in out
    rows = {line[:28].strip(): line[28:].split() for line in out.splitlines()
            if line.startswith(("sorted by hand", "random /"))}
    assert set(rows) == {"sorted by hand / fifo", "random / fifo (before)", "random / prefix"}
    assert int(rows["random / prefix"][0]) < int(rows["random / fifo (before)"][0])
