"""`batchgen generate`'s flags, made from GenerateSettings' fields: one source of truth for the CLI,
the YAML config (its keys are the field names) and the Prefect form (the model's JSON schema).

A field `max_num_seqs` is the flag `--max-num-seqs`; a bool that defaults to True is turned off by
`--no-...`; a list takes several values; a dict takes repeated KEY=VALUE (JSON values). A few flags
keep the names users know (FLAG_NAMES).
"""

from __future__ import annotations

import argparse
import json
import typing
from typing import Any, Literal

from batchgen.settings import GenerateSettings

FLAG_NAMES = {"vllm": "--vllm-option", "enable_prefix_caching": "--no-prefix-caching",
              "progress": "--no-progress", "lora_adapters": "--lora-adapter"}
APPEND = {"stop"}
# where a field's title (the Prefect form's label) is too short to say what a flag takes
TITLES = {"input": "Prompt dataset: Parquet or JSONL file(s), a folder, a glob or a URI"}  # repeated flags (a stop string may start with '-'); other lists take several values


def _base(annotation) -> tuple[Any, bool]:
    """The annotation without Optional, and whether it was optional."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", None)) \
            and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return annotation, False


# --help's groups, in the order a person reads them (vLLM's engine args are grouped so too); a field in
# none of them lands in the last
GROUPS = (("input and output", ("config", "input", "output", "run_id", "keep_columns", "output_format", "reuse_from",
                                "shard_size", "shard_by", "progress", "max_error_rate", "error_rate_min_rows",
                                "max_hours", "max_cost", "price_per_hour")),
          ("model and prompts", ("model", "engine", "prompt_format", "chat_template_kwargs", "too_long",
                                 "lora_adapters")),
          ("sampling", ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos",
                        "response_format", "n", "logprobs", "repetition_stop",
                        "max_reasoning_tokens")),
          ("batching and memory", ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "kv_cache_memory",
                                   "kv_cache_memory_fraction", "kv_cache_tokens", "block_size",
                                   "enable_prefix_caching", "admission")),
          ("engine internals (each default is the measured best; docs/engine.md)",
           ("dtype", "device", "compile", "batch_invariant", "quantization", "fp32_kernel", "sampler",
            "attention_backend", "cuda_graphs", "speculative_ngram", "prompt_lookup_min", "prompt_lookup_max",
            "vllm")))


def _default_text(field) -> str:
    """The default as --help shows it ('' where there is none to show)."""
    if field.is_required():
        return "required"
    d = field.get_default(call_default_factory=True)
    if d is None or d == [] or d == {}:
        return ""
    if isinstance(d, bool):
        return "on" if d else "off"
    return f"default {', '.join(map(str, d)) if isinstance(d, list) else d}"


def add_settings_flags(p: argparse.ArgumentParser) -> None:
    """Every setting as a flag, in GROUPS, each with its one-line title and default (the longer help
    of each is the Prefect form's and docs/generate.md's)."""
    group_of = {name: g for g, names in GROUPS for name in names}
    groups = {g: p.add_argument_group(g) for g, _ in GROUPS}
    other = None
    for name, field in GenerateSettings.model_fields.items():
        if name in group_of:
            target = groups[group_of[name]]
        else:
            other = other or p.add_argument_group("other")
            target = other
        kind, _ = _base(field.annotation)
        origin = typing.get_origin(kind)
        flag = FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
        default = _default_text(field)
        title = TITLES.get(name, field.title or name.replace("_", " "))
        help_ = title + (f" ({default})" if default and kind is not bool else "")
        help_ = help_.replace("%", "%%")  # argparse formats help with %
        common = dict(dest=name, default=None, help=help_)
        add = target.add_argument
        if kind is bool:
            if field.default is True:
                add(flag if flag.startswith("--no-") else "--no-" + name.replace("_", "-"),
                               action="store_false", **{**common, "help": "turn off: " + help_ + " (on by default)"})
            else:
                add(flag, action="store_true", **common)
        elif origin is dict:
            add(flag, action="append", metavar="KEY=VALUE", **{**common, "help": help_ + " (repeatable; JSON values)"})
        elif origin is list:
            add(flag, action="append" if name in APPEND else "extend",
                           nargs=None if name in APPEND else "+", **common)
        elif origin is Literal:
            add(flag, choices=list(typing.get_args(kind)), **common)
        else:
            add(flag, type=kind if kind in (int, float) else str, **common)


def settings_values(args: argparse.Namespace) -> dict[str, Any]:
    """The flags that were given, as settings values (KEY=VALUE pairs parsed into dicts)."""
    values: dict[str, Any] = {}
    for name, field in GenerateSettings.model_fields.items():
        v = getattr(args, name, None)
        if v is None:
            continue
        if typing.get_origin(_base(field.annotation)[0]) is dict:
            values[name] = dict(_pair(item, FLAG_NAMES.get(name, name)) for item in v)
        else:
            values[name] = v
    return values


def _pair(item: str, flag: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ValueError(f"{flag} {item!r}: expected KEY=VALUE")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw
