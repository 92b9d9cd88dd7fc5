"""batchgen's float32 CPU matmul for decode (gemv.cpp), built on the machine that runs it.

The kernel is compiled with the machine's own vector instructions (-march=native), so it is built
here, not shipped: once per machine, source, torch version and compiler, into BATCHGEN_KERNEL_DIR
(default BATCHGEN_HOME/kernels), about 12 s; later processes load the cached library. Where there is
no C++ compiler, or the build fails, `load()` says why and the caller keeps oneDNN's kernel.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from batchgen.config import batchgen_home

SOURCE = Path(__file__).with_name("gemv.cpp")
_loaded: int | str | None = None  # this process: the block width once loaded, or why it could not be


def kernel_dir() -> Path:
    return Path(os.environ.get("BATCHGEN_KERNEL_DIR", batchgen_home() / "kernels"))


def _cpu_flags() -> str:
    """What -march=native compiles for: the CPU's feature flags (a library built for one CPU may not
    run on another that lacks its instructions; BATCHGEN_HOME can be a shared disk)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _command(compiler: str, out: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    arch = "-mcpu=native" if platform.machine() in ("aarch64", "arm64") else "-march=native"
    lib = Path(torch.__file__).parent / "lib"
    return [compiler, "-O3", arch, "-fopenmp", "-shared", "-fPIC", "-std=c++20", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *(f"-I{p}" for p in include_paths()), str(SOURCE), f"-L{lib}", "-lc10", "-ltorch_cpu", "-o", str(out)]


def library_path(compiler: str) -> Path:
    key = hashlib.sha256("\n".join([SOURCE.read_text(), torch.__version__, compiler, platform.machine(),
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    return kernel_dir() / f"gemv-{key}.so"


def load() -> int | str:
    """The kernel's column-block width (an int) once its library is loaded in this process, building
    it first where this machine has none; or, as a str, why it cannot be used here."""
    global _loaded
    if _loaded is not None:
        return _loaded
    compiler = os.environ.get("CXX", "c++")
    try:
        if shutil.which(compiler) is None:
            raise RuntimeError(f"no C++ compiler ({compiler!r} not found)")
        so = library_path(compiler)
        if not so.exists():
            so.parent.mkdir(parents=True, exist_ok=True)
            # built beside its final name, then renamed: a process that loads it never sees half a file
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)
            os.close(fd)
            try:
                r = subprocess.run(_command(compiler, Path(tmp)), capture_output=True, text=True)
                if r.returncode:
                    raise RuntimeError(f"build failed: {r.stderr.strip()[-300:]}")
                os.replace(tmp, so)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        torch.ops.load_library(str(so))
        torch.library.register_fake("batchgen_gemv::gemv")(
            lambda x, w, n: x.new_empty((*x.shape[:-1], n)))
        _loaded = int(torch.ops.batchgen_gemv.block_width())
    except (OSError, RuntimeError) as e:
        _loaded = f"{type(e).__name__}: {e}"
    return _loaded


def block(weight: torch.Tensor, width: int) -> torch.Tensor:
    """[N, K] -> [ceil(N / width), K, width], the last block's missing rows zero (never stored out)."""
    n, k = weight.shape
    nb = -(-n // width)
    padded = weight.new_zeros(nb * width, k)
    padded[:n] = weight
    return padded.view(nb, width, k).transpose(1, 2).contiguous()


def gemv(x: torch.Tensor, blocked: torch.Tensor, n: int) -> torch.Tensor:
    return torch.ops.batchgen_gemv.gemv(x, blocked, n)
