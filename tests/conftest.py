"""Shared factories: a tiny random-init Llama built here, the real SmolLM2 directory, small datasets."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    from batchgen.model.prepare import resolve_model

    return resolve_model("smollm2-135m")


def build_tiny_model(dest: Path, real_model_dir: Path, model_type: str = "llama", seed: int = 0) -> Path:
    """A 2-layer random-init checkpoint with SmolLM2's tokenizer, saved by transformers itself."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    if model_type == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.save_pretrained(dest)
    for name in TOKENIZER_FILES:
        if (real_model_dir / name).is_file():
            shutil.copy(real_model_dir / name, dest / name)
    return dest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, real_model_dir) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), real_model_dir)


def write_prompts(path: Path, prompts: list, ids: list | None = None, **extra_columns) -> Path:
    cols = {}
    if ids is not None:
        cols["id"] = ids
    cols["prompt"] = prompts
    cols.update(extra_columns)
    pq.write_table(pa.table(cols), path)
    return path


@pytest.fixture
def seed_prompts() -> Path:
    return SHARED_DATA / "alpaca_seed_prompts.parquet"


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory):
    """One temporary Prefect API for every flow test in the session (about 10 s to start)."""
    import os

    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect-home"))
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
