"""Prefix-aware admission on the real path: the order benchmark (batchgen.benchmarks.prefix) at a small
size on the tiny model. The scheduler's own rules are tested alone in test_block_manager."""


def test_the_prefix_order_benchmark_runs_at_a_small_size(tiny_model_dir, capsys):
    """`python -m batchgen.benchmarks.prefix` (320 rows by default) at 24 rows on the tiny model: the four
    variants with 1 and 2 workers, ratios, conditions and the staging cost printed; random order computes
    fewer prompt tokens with prefix admission than first come, and fewer again in prefix-ordered shards
    (exact counts, not speed)."""
    from batchgen.benchmarks import prefix

    prefix.main(["--rows", "24", "--shard-size", "6", "--max-num-seqs", "4", "--kv-cache-tokens", "640",
                 "--new-tokens", "2", "--repeats", "1", "--model", str(tiny_model_dir), "--stage-rows", "3000"])
    out = capsys.readouterr().out
    assert "conditions: 24 rows, 8 system prompts" in out and "targets, random, prefix shards, 2 workers" in out
    assert "staging the prefix order of 3,000 rows" in out
    rows = {(line[:27].strip(), int(line[27:35])): line[35:].split() for line in out.splitlines()
            if line.startswith(("sorted by hand", "random,"))}
    assert set(rows) == {(name, w) for name in prefix.LABELS.values() for w in (1, 2)}
    for w in (1, 2):
        computed = {name: int(rows[(label, w)][0]) for name, label in prefix.LABELS.items()}
        assert computed["prefix"] <= computed["admission"] < computed["fifo"], computed
        assert computed["prefix"] < computed["fifo"]


def test_the_length_admission_benchmark_runs_at_a_small_size(tiny_model_dir, capsys):
    """`python -m batchgen.benchmarks.lengths` at 24 rows on the tiny model: every variant, its tail share
    and ratios, and the verdict against the default printed; longest-first admission keeps at least as
    many rows running per step as first come (batch occupancy, not speed)."""
    from batchgen.benchmarks import lengths

    lengths.main(["--rows", "24", "--shard-size", "12", "--max-num-seqs", "4", "--short", "2", "--long", "12",
                  "--every", "6", "--repeats", "1", "--model", str(tiny_model_dir)])
    out = capsys.readouterr().out
    assert "conditions: 24 chat prompts, 4 allowed 12 new tokens and the rest 2" in out
    assert "length admission / the default (prefix):" in out
    rows = {line[:30].strip(): line[30:].split() for line in out.splitlines() if line.startswith(("random", "longest"))}
    assert set(rows) == {"longest first / fifo", "random / fifo", "random / prefix", "random / length",
                         "random / prefix-length"}
    mean_running = {k: float(v[3]) for k, v in rows.items()}
    assert mean_running["random / length"] >= mean_running["random / fifo"], mean_running
