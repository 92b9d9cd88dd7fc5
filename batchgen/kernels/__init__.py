"""batchgen's C++ CPU kernels (the `.cpp` files beside this one), built on the machine that runs them.

Each kernel is compiled with the machine's own vector instructions (-march=native), so it is built
here, not shipped: once per machine, source, torch version and compiler, into BATCHGEN_KERNEL_DIR
(default BATCHGEN_HOME/kernels), about 10 s each; later processes load the cached library. Where
there is no C++ compiler, or the build fails, `load()` says why and the caller keeps its torch path.

- gemv.cpp: the float32 decode matmul (batchgen.model.gemv);
- sample.cpp: the fused sampler (batchgen.engine.sampler);
- qgemv.cpp: the low-bit matmul on a GGUF's Q4_1 / Q8_0 blocks (batchgen.model.ggml);
- attention.cpp: paged attention over the KV blocks in place (batchgen.engine.attention);
- bgemm.cpp: the batch-invariant bfloat16 matmul, on AMX or AVX512_BF16 (batchgen.model.bgemm);
- rmsnorm.cpp: the batch-invariant RMSNorm, each row summed in one fixed order (batchgen.model.rmsnorm);
- rope.cpp: RoPE in one pass, rounded where PyTorch's ops round (batchgen.model.rope).
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from batchgen.config import batchgen_home, cpu_capability

NAMES = ("gemv", "sample", "qgemv", "attention", "bgemm", "rmsnorm", "rope", "silumul")
# kernels that hold a build per instruction set and choose one at run time: compiled for the baseline
# architecture, with each instruction set's code under its own target pragma (-march=native would let
# every function use the build machine's widest instructions, and a narrower region could not call
# its own intrinsics)
RUNTIME_DISPATCH = ("qgemv",)


def source(name: str) -> Path:
    return Path(__file__).with_name(f"{name}.cpp")


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


# the instructions a kernel is built for, under ATEN_CPU_CAPABILITY (batchgen.config.cpu_capability) on x86:
# the class's baseline, tuned for this CPU; and the widest instruction set a run-time-dispatch kernel picks
CAPPED_ARCH = {"avx2": ["-march=x86-64-v3", "-mtune=native"], "default": ["-march=x86-64", "-mtune=native"]}
CAPPED_ISA = {"avx2": 2, "default": 1}  # qgemv.cpp's numbering


def _arch(name: str) -> list[str]:
    """The compiler's instruction-set flags for kernel `name` on this machine, under its capability cap."""
    cap = cpu_capability()
    if platform.machine() in ("aarch64", "arm64"):
        return [] if name in RUNTIME_DISPATCH else ["-mcpu=native"]
    if name in RUNTIME_DISPATCH:  # built for the baseline; it picks its widest build at run time, up to the cap
        return [f"-DBATCHGEN_ISA_CAP={CAPPED_ISA[cap]}"] if cap in CAPPED_ISA else []
    return CAPPED_ARCH.get(cap, ["-march=native"])


def _command(name: str, compiler: str, out: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    lib = Path(torch.__file__).parent / "lib"
    return [compiler, "-O3", *_arch(name), "-fopenmp", "-shared", "-fPIC", "-std=c++20", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *(f"-I{p}" for p in include_paths()), str(source(name)), f"-L{lib}", "-lc10", "-ltorch_cpu",
            "-o", str(out)]


def source_text(name: str) -> str:
    """Kernel `name`'s source with the text of the headers beside it that it includes (vec.h): a
    change to either is a new build."""
    text = source(name).read_text()
    headers = re.findall(r'^#include "([^"]+)"', text, flags=re.M)
    return text + "".join(source(name).with_name(h).read_text() for h in headers)


def library_path(name: str, compiler: str) -> Path:
    key = hashlib.sha256("\n".join([source_text(name), torch.__version__, compiler, platform.machine(),
                                    _cpu_flags(), *_arch(name)]).encode()).hexdigest()[:16]
    return kernel_dir() / f"{name}-{key}.so"


def builds(*names: str) -> str:
    """A short digest of kernels `names`' builds (source, torch, compiler, CPU): a speed measured on
    them is stale once one of them changes (batchgen.engine.precision names its records with it)."""
    compiler = os.environ.get("CXX", "c++")
    return hashlib.sha256(" ".join(library_path(n, compiler).name for n in names).encode()).hexdigest()[:8]


def compile_cache_dir() -> Path:
    """Inductor's on-disk cache for compiled steps, one per build of these kernels: a compiled step calls
    them by their schemas, and a step cached before an op's arguments changed crashed the process when it
    called the new build."""
    return batchgen_home() / "inductor" / f"kernels-{builds(*NAMES)}"


def load(name: str) -> str | None:
    """Load kernel `name`'s library into this process (its ops appear under torch.ops), building it
    first where this machine has none. None once loaded; else, why it cannot be used here.

    Holds no state of its own: PyTorch records the libraries a process has loaded, and a build that
    failed leaves its reason beside where the library would be (so no process on this machine tries
    that source with that compiler again; a changed source or compiler is a new key)."""
    compiler = os.environ.get("CXX", "c++")
    try:
        if shutil.which(compiler) is None:
            raise RuntimeError(f"no C++ compiler ({compiler!r} not found)")
        if any(Path(p).name.startswith(f"{name}-") for p in torch.ops.loaded_libraries):
            return None  # loaded (a process holds one build of a kernel: its ops' names are taken)
        so = library_path(name, compiler)
        failed = so.with_suffix(".failed")
        if failed.exists():
            raise RuntimeError(failed.read_text())
        if not so.exists():
            so.parent.mkdir(parents=True, exist_ok=True)
            # built beside its final name, then renamed: a process that loads it never sees half a file
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)
            os.close(fd)
            try:
                r = subprocess.run(_command(name, compiler, Path(tmp)), capture_output=True, text=True)
                if r.returncode:
                    failed.write_text(f"build failed: {r.stderr.strip()[-300:]}")
                    raise RuntimeError(failed.read_text())
                os.replace(tmp, so)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        torch.ops.load_library(str(so))
        return None
    except (OSError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"


def load_op(name: str, op: str, fake: Callable) -> str | None:
    """`load(name)`, then give its op `op` ("namespace::op") the shape-only kernel `fake`, so that a
    compiled step traces through the op (opaque to Inductor); once per process, as the dispatcher
    remembers it. None once loaded; else why the kernel cannot be used here."""
    why = load(name)
    if why is None and not torch._C._dispatch_has_kernel_for_dispatch_key(op, "Meta"):
        torch.library.register_fake(op)(fake)
    return why


def build_all(names: Iterable[str] = NAMES) -> list[str]:
    """Build (or find) and load every kernel now (or those named), as `batchgen kernels build` does at
    set-up, so that a machine's first run does not pay for it: a line per kernel, ready at its path or
    why not."""
    compiler = os.environ.get("CXX", "c++")
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ValueError(f"no kernel named {', '.join(unknown)} (kernels: {', '.join(NAMES)})")
    lines = []
    for name in names:
        why = load(name)
        lines.append(f"{name}: ready, {library_path(name, compiler)}" if why is None else
                     f"{name}: unavailable here ({why}); its torch path serves instead")
    return lines
