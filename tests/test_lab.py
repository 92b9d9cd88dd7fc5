"""The cache lab counts what the engine actually computed, and both modes agree on the tokens."""

from batchgen.cli import main
from batchgen.benchmarks.lab import expected_positions, run_decode_lab


def test_formulas():
    assert expected_positions(10, 5, cache=True) == 14
    assert expected_positions(10, 5, cache=False) == 5 * 10 + 10  # 10 + 11 + 12 + 13 + 14


def test_engine_counts_match_the_formulas_on_a_model(tiny_model_dir):
    cache, full = run_decode_lab(tiny_model_dir, prompt_tokens=20, new_tokens=7)
    assert cache.positions_counted == cache.positions_expected == 26
    assert full.positions_counted == full.positions_expected == 7 * 20 + 21
    assert cache.tokens == full.tokens and len(cache.tokens) == 7


def test_lab_cli_on_the_real_model(capsys):
    assert main(["lab", "decode", "--prompt-tokens", "16", "--new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "kv-cache" in out and "recompute" in out and "same tokens: True" in out
    assert " 21 " in out and " 111 " in out  # 16+6-1 and 6*16+15
