"""The engine's plan: what the settings come to on this machine, as one typed value.

`--dtype auto`, `--quantization`, `--fp32-kernel auto`, `--attention-backend auto` and
`--batch-invariant` are resolved once, by batchgen.engine.resolve.plan_engine, from the settings and
the probed machine. The engine loads what the plan names. Each attempt's engine conditions in
run.json hold it as fields (`plan`); a resume and `--reuse-from` read it back with
EnginePlan.from_fields. The prose beside it in the conditions (`dtype_choice`, `batch_invariant`) is
made from it for people and never read back. vLLM's create_engine_config -> VllmConfig is the model:
resolved once, passed down.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

# batchgen's matmul kernels that sum each row in one fixed order, whatever the rows beside it
INVARIANT_MATMULS = ("gemv", "bgemm", "qgemv")


class PlanError(ValueError):
    """Settings this machine cannot carry out as asked (`--batch-invariant on` where no plan can be)."""


@dataclass(frozen=True)
class EnginePlan:
    engine: str  # "native" | "vllm"
    device: str
    dtype: str  # the dense weights' dtype; with "gguf" or "int4" weights, the activations'
    weights: str  # "dense" | "gguf" (the model's own blocks) | "int4" | vLLM's `quantization` option
    matmul: str  # "gemv" | "bgemm" | "qgemv" | "onednn" | "int4" | "torch" | "vllm"
    attention: str  # "cpu" (batchgen's C++ paged kernel) | "torch" | "flashinfer" | "none" (no cache) | "vllm"
    batch_invariant: bool  # a row's tokens do not depend on the rows beside it or the batch's size
    # why each field is what it is, for people: {"dtype": ..., "matmul": ..., "attention": ...,
    # "batch_invariant": ...}; never read back to decide anything
    why: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def quantization(self) -> str:
        """The native engine's `quantization` setting that loads these weights."""
        return "none" if self.weights == "dense" else self.weights

    def fields(self) -> dict[str, Any]:
        """As run.json stores it."""
        return asdict(self)

    @classmethod
    def from_fields(cls, doc: dict[str, Any]) -> EnginePlan:
        """The plan a run recorded (fields()), read back."""
        return cls(**{f.name: doc[f.name] for f in fields(cls) if f.name in doc})

    def invariance(self) -> str:
        """The conditions' `batch_invariant` line, for people: on or off, and why."""
        return f"{'on' if self.batch_invariant else 'off'}: {self.why.get('batch_invariant', '')}".rstrip(": ")

    def describe(self) -> str:
        """One line for people: the weights, the kernels, and whether the rows are batch-invariant."""
        weights = {"dense": f"{self.dtype} weights", "gguf": "the model's GGUF blocks (float32 activations)",
                   "int4": "int4 weights (bfloat16 activations)"}.get(self.weights, f"{self.weights} weights")
        return (f"{self.engine} on {self.device}: {weights}, matmul {self.matmul}, attention {self.attention}, "
                f"batch-invariant {'yes' if self.batch_invariant else 'no'}")
