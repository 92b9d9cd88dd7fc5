"""A GGUF's low-bit blocks as the model's weights: Q4_1 and Q8_0 matrices multiplied as they ship, by
batchgen's kernel (batchgen/kernels/qgemv.cpp, built on the machine that runs it).

The default model (SmolLM2-135M-Instruct) ships as a GGUF whose layers are Q4_1 blocks and whose
embedding (the tied LM head) is Q8_0. `batchgen model prepare` dequantizes it into safetensors for the
other paths; `--quantization gguf` instead reads the GGUF's own blocks, so the matmuls compute the
model exactly as the GGUF defines it, reading 0.625 (Q4_1) or 1.0625 (Q8_0) bytes a weight.

llama.cpp's converter stores the query and key rows of a Llama model in an interleaved RoPE order;
HF's loader (transformers' GGUF reverse permutation) undoes it, and so does `_unpermute` here, on
whole rows (a row's blocks run along K, so a row permutation moves blocks untouched).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

QK = 32  # weights per block
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}  # d (fp16) [+ m (fp16)] + the quants
ARCHITECTURES = ("llama",)  # GGUF architectures whose names and q/k row order this reader knows
# GGUF's tensor names for the Llama family -> HF's
LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}


class GGUFError(RuntimeError):
    """The GGUF is missing, or holds a matrix in a format this kernel does not multiply."""


def load() -> int | str:
    """The instruction set the kernel runs here (512: AVX-512, 2: AVX2, 1: portable) once its library
    is loaded in this process; or, as a str, why it cannot be used here."""
    from batchgen import kernels

    why = kernels.load("qgemv")
    if why is not None:
        return why
    if not torch._C._dispatch_has_kernel_for_dispatch_key("batchgen_qgemv::q4_1", "Meta"):
        # shape-only kernels, so that a compiled step traces through the ops
        torch.library.register_fake("batchgen_qgemv::q4_1")(
            lambda x, qs, d, m, n, isa=0: x.new_empty((*x.shape[:-1], n)))
        torch.library.register_fake("batchgen_qgemv::q8_0")(
            lambda x, qs, d, n, isa=0: x.new_empty((*x.shape[:-1], n)))
        torch.library.register_fake("batchgen_qgemv::swiglu")(
            lambda x, qs, d, m, n, isa=0: x.new_empty((*x.shape[:-1], n // 2)))
        torch.library.register_fake("batchgen_qgemv::add")(lambda x, qs, d, m, n, h, isa=0: torch.empty_like(h))
    return int(torch.ops.batchgen_qgemv.isa())


ISA_NAMES = {512: "AVX-512", 2: "AVX2", 1: "portable C++"}


def isa_name() -> str:
    """The instruction set the kernel runs on this CPU (chosen at run time), for the run's conditions."""
    got = load()
    return f"unavailable ({got})" if isinstance(got, str) else ISA_NAMES.get(got, str(got))


def find_gguf(model_dir: str | Path) -> Path:
    found = sorted(Path(model_dir).glob("*.gguf"))
    if len(found) != 1:
        raise GGUFError(f"quantization gguf reads the model's GGUF file, and {model_dir} has "
                        f"{'none' if not found else len(found)} (*.gguf): the default model's is placed there "
                        f"by `batchgen model prepare`")
    return found[0]


GROUP = 8  # columns whose blocks the kernel holds side by side (qgemv.cpp's G)


class BlockLinear:
    """y = x W^T (+ b) for x float32 [..., K], with W [N, K] held in GGUF blocks along K, G = GROUP
    columns' blocks side by side so that a decode step streams them in order:
    qs [N/G, K/32, G, 16 (Q4_1) or 32 (Q8_0)], d and (Q4_1) m [N/G, K/32, G] fp16 (N padded to G with
    zero columns, never written out)."""

    __slots__ = ("kind", "qs", "d", "m", "bias", "out_features", "in_features", "nbytes", "dtype", "isa", "gated")
    kernel = "qgemv"  # the matmul kernel's name, as an EnginePlan gives it

    def __init__(self, kind: str, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                 bias: torch.Tensor | None = None, isa: int = 0):
        """qs [N, K/32, bytes], d and m [N, K/32]: a matrix's blocks row by row, as the GGUF holds them."""
        if kind not in BLOCK_BYTES:
            raise GGUFError(f"block format {kind!r}: one of {', '.join(BLOCK_BYTES)}")
        self.kind, self.bias, self.isa = kind, bias, isa
        self.gated = None  # True once fuse_swiglu has taken this [gate; up] weight
        self.out_features, self.in_features = qs.shape[0], qs.shape[1] * QK
        self.qs, self.d = _grouped(qs), _grouped(d)
        self.m = None if m is None else _grouped(m)
        self.nbytes = sum(t.numel() * t.element_size() for t in (qs, d, m) if t is not None)
        self.dtype = torch.float32  # the activations'

    @classmethod
    def from_raw(cls, kind: str, raw: np.ndarray, bias: torch.Tensor | None = None) -> BlockLinear:
        """raw: uint8 [N, K/32 * block bytes], the GGUF's bytes of an [N, K] matrix."""
        n = raw.shape[0]
        blocks = np.ascontiguousarray(raw).reshape(n, -1, BLOCK_BYTES[kind])

        def half(lo: int) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(blocks[..., lo:lo + 2]).view(np.float16)[..., 0].copy())

        if kind == "Q4_1":
            return cls(kind, torch.from_numpy(np.ascontiguousarray(blocks[..., 4:])), half(0), half(2), bias)
        return cls(kind, torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8)), half(0), None, bias)

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(qs [N, K/32, bytes], d [N, K/32], m [N, K/32] or None): the blocks row by row again."""
        n = self.out_features
        return _ungrouped(self.qs, n), _ungrouped(self.d, n), None if self.m is None else _ungrouped(self.m, n)

    @staticmethod
    def cat(parts: list[BlockLinear], bias: torch.Tensor | None = None) -> BlockLinear:
        """Matrices of one format stacked by rows (fused q/k/v, gate/up)."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise GGUFError(f"cannot fuse matrices of formats {sorted(kinds)}")
        qs, d, m = zip(*(p.rows() for p in parts))
        return BlockLinear(parts[0].kind, torch.cat(qs), torch.cat(d), None if m[0] is None else torch.cat(m), bias)

    @property
    def layout(self) -> str:
        return f"{self.kind} blocks (batchgen qgemv{', SwiGLU in the kernel' if self.gated else ''})"

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: the weights the blocks stand for (as GGUF's reference dequantizes them)."""
        qs, d, m = self.rows()
        if self.kind == "Q4_1":
            q = torch.cat([qs & 15, qs >> 4], dim=-1).float()  # byte j: weight j, and j + 16
            w = d.float()[..., None] * q + m.float()[..., None]
        else:
            w = d.float()[..., None] * qs.float()
        return w.reshape(self.out_features, self.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "Q4_1":
            y = torch.ops.batchgen_qgemv.q4_1(x, self.qs, self.d, self.m, self.out_features, self.isa)
        else:
            y = torch.ops.batchgen_qgemv.q8_0(x, self.qs, self.d, self.out_features, self.isa)
        return y if self.bias is None else y + self.bias

    def fuse_swiglu(self) -> bool:
        """Let `swiglu(x)` apply SwiGLU's activation in the kernel (as batchgen.model.linear.Linear's):
        this [gate; up] weight's blocks stay as they are, a kernel task runs a group of gate columns
        and the same up columns. False where the halves are not whole groups or there is a bias."""
        if self.bias is not None or self.out_features % (2 * GROUP):
            return False
        self.gated = True
        return True

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x Wg^T) * (x Wu^T) [.., out_features / 2]: the bits of this matmul then the silumul kernel
        (vec.h's SiLU, built for the instructions the kernel runs), without the [.., 2I] product."""
        return torch.ops.batchgen_qgemv.swiglu(x, self.qs, self.d, self.m, self.out_features, self.isa)

    def add_to(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """h + x W^T (+ b), as batchgen.model.linear.Linear.add_to: the add as each tile leaves the
        kernel (the bits of h + self(x))."""
        if self.bias is None and h.dtype == torch.float32:
            return torch.ops.batchgen_qgemv.add(x, self.qs, self.d, self.m, self.out_features, h, self.isa)
        return h + self(x)


def _grouped(t: torch.Tensor) -> torch.Tensor:
    """[N, KB, ...] -> [N/G, KB, G, ...]: each group of G rows' blocks side by side (zero rows pad N)."""
    n = t.shape[0]
    ng = -(-n // GROUP)
    padded = t.new_zeros((ng * GROUP, *t.shape[1:]))
    padded[:n] = t
    return padded.unflatten(0, (ng, GROUP)).transpose(1, 2).contiguous()


def _ungrouped(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.transpose(1, 2).flatten(0, 1)[:n]


def _unpermute(raw: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's RoPE row order for q (heads) or k (KV heads): rows [h, 2, D/2] -> [h, D/2, 2]."""
    n = raw.shape[0]
    order = np.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(1, 2).reshape(n)
    return raw[order]


class GGUFBlocks:
    """The low-bit matrices of a Llama-family GGUF, by HF name (`model.layers.3.mlp.up_proj.weight`)."""

    def __init__(self, path: str | Path, num_heads: int, num_kv_heads: int):
        from gguf import GGUFReader

        self.path = Path(path)
        reader = GGUFReader(str(path))
        field = reader.fields.get("general.architecture")
        arch = bytes(field.parts[field.data[0]]).decode() if field is not None else "unknown"
        if arch not in ARCHITECTURES:  # the row order of q and k, and the tensor names, are the llama family's
            raise GGUFError(f"{self.path.name} is a {arch!r} GGUF; quantization gguf reads {', '.join(ARCHITECTURES)}")
        self.tensors = {t.name: t for t in reader.tensors}
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads

    @staticmethod
    def gguf_name(hf_name: str) -> str:
        if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
            return "token_embd.weight" if hf_name.startswith("model.") else "output.weight"
        parts = hf_name.split(".")  # model.layers.{i}.{module}.{proj}.weight
        module = ".".join(parts[3:5])
        for g, h in LAYER_NAMES.items():
            if h == module:
                return f"blk.{parts[2]}.{g}.{parts[-1]}"
        raise GGUFError(f"no GGUF name for {hf_name}")

    def has(self, hf_name: str) -> bool:
        return self.gguf_name(hf_name) in self.tensors

    def kind(self, hf_name: str) -> str:
        return self.tensors[self.gguf_name(hf_name)].tensor_type.name

    def linear(self, hf_name: str) -> BlockLinear:
        name = self.gguf_name(hf_name)
        t = self.tensors.get(name)
        if t is None:
            raise GGUFError(f"{self.path.name}: no tensor {name} (for {hf_name})")
        kind = t.tensor_type.name
        if kind not in BLOCK_BYTES:
            raise GGUFError(f"{self.path.name}: {name} is {kind}; the kernel multiplies {', '.join(BLOCK_BYTES)}")
        raw = np.asarray(t.data)
        if name.endswith("attn_q.weight"):
            raw = _unpermute(raw, self.num_heads)
        elif name.endswith("attn_k.weight"):
            raw = _unpermute(raw, self.num_kv_heads)
        return BlockLinear.from_raw(kind, raw)
