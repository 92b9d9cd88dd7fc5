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
APPEND = {"stop"}  # repeated flags (a stop string may start with '-'); other lists take several values


def _base(annotation) -> tuple[Any, bool]:
    """The annotation without Optional, and whether it was optional."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", None)) \
            and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return annotation, False


def add_settings_flags(p: argparse.ArgumentParser) -> None:
    for name, field in GenerateSettings.model_fields.items():
        kind, _ = _base(field.annotation)
        origin = typing.get_origin(kind)
        flag = FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
        help_ = " ".join(x for x in (field.title, f"({field.description})" if field.description else None) if x)
        help_ = help_.replace("%", "%%")  # argparse formats help with %
        common = dict(dest=name, default=None, help=help_)
        if kind is bool:
            if field.default is True:
                p.add_argument(flag if flag.startswith("--no-") else "--no-" + name.replace("_", "-"),
                               action="store_false", **{**common, "help": "turn off: " + help_})
            else:
                p.add_argument(flag, action="store_true", **common)
        elif origin is dict:
            p.add_argument(flag, action="append", metavar="KEY=VALUE", **{**common, "help": help_ + " (repeatable; JSON values)"})
        elif origin is list:
            p.add_argument(flag, action="append" if name in APPEND else "extend",
                           nargs=None if name in APPEND else "+", **common)
        elif origin is Literal:
            p.add_argument(flag, choices=list(typing.get_args(kind)), **common)
        else:
            p.add_argument(flag, type=kind if kind in (int, float) else str, **common)


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
