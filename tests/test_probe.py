"""The hardware probe is measured once per machine, then read back from its cache."""

from batchgen.metrics.probe import cached_probe, machine_key


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
