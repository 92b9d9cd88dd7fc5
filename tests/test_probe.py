"""The hardware probe is measured once per machine, then read back from its cache."""

from batchgen.metrics.probe import cached_probe, machine_key, probe_device


def test_probe_is_cached_per_machine(tmp_path, monkeypatch):
    monkeypatch.delenv("BATCHGEN_REPROBE", raising=False)
    first = cached_probe("cpu", cache_dir=tmp_path)
    assert first["probe_source"] == "measured in this run" and first["peak_read_bytes_per_s"] > 0
    assert (tmp_path / f"{machine_key('cpu')}.json").is_file()
    second = cached_probe("cpu", cache_dir=tmp_path)
    assert second["probe_source"].startswith("cached")
    assert second["peak_read_bytes_per_s"] == first["peak_read_bytes_per_s"]
    assert second["probe_measured_at"] == first["probe_measured_at"]  # when the figures were measured
    monkeypatch.setenv("BATCHGEN_REPROBE", "1")
    assert cached_probe("cpu", cache_dir=tmp_path)["probe_source"] == "measured in this run"


def test_a_matmul_that_crawls_is_measured_on_fewer_rows():
    """Where the first product on CRAWL_ROWS rows is slower than crawl_s (bf16 on a CPU without bf16
    math: a full product would take a minute), that call is the measurement, on those rows; otherwise
    the full product's best of the repeats."""
    import torch

    from batchgen.metrics.probe import CRAWL_ROWS, matmul_flops

    a, b = torch.randn(256, 128), torch.randn(128, 128)
    crawl, crawl_rows = matmul_flops(a, b, "cpu", repeats=2, crawl_s=0.0)
    full, full_rows = matmul_flops(a, b, "cpu", repeats=2, crawl_s=float("inf"))
    assert (crawl_rows, full_rows) == (CRAWL_ROWS, 256)
    assert crawl > 0 and full > 0
    probe = probe_device("cpu", mib=8, repeats=1)
    assert probe["probe_matmul_rows_fp32"] in (CRAWL_ROWS, 512) and probe["peak_flops_bfloat16"] > 0
