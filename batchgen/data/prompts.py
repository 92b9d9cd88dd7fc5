"""Input processing: one dataset row -> (id, prompt token ids, SamplingParams), or a row error.

Row-level problems never stop a run; they become `errors/` rows with a reason a person can read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any

from batchgen.config import ConfigError, RunConfig, SamplingParams, derive_seed, int_range
from batchgen.data.reader import InvalidValue
from batchgen.data.response_format import normalise_response_format


@dataclass
class PreparedRow:
    id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    truncated_from: int | None = None  # original prompt length when the too_long policy truncated it
    n: int = 1  # samples to generate from this prompt

    def samples(self) -> list["PreparedRow"]:
        """One request per sample. Sample 0 keeps the row's seed; sample k > 0 derives its own from it,
        so every sample differs, and each is the same on a re-run and on either engine."""
        if self.n == 1:
            return [self]
        return [replace(self, id=sample_request_id(self.id, k), n=1,
                        sampling=self.sampling if k == 0 else replace(self.sampling,
                                                                      seed=derive_seed(self.sampling.seed, f"sample-{k}")))
                for k in range(self.n)]


def sample_request_id(row_id: str, k: int) -> str:
    """The engine's id for sample k of a row (the writer maps it back to (id, sample_index))."""
    return f"{row_id}\x1e{k}"


@dataclass
class RowError:
    id: str
    error: str
    stage: str  # "validate" | "tokenize" | "engine"


def _messages(value: Any) -> list[dict[str, str]]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"messages is not valid JSON ({e.msg})") from None
    if not isinstance(value, list) or not value:
        raise ValueError("messages must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must have string 'role' and 'content'")
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"messages[{i}] has unknown role {m['role']!r}")
        out.append({"role": m["role"], "content": m["content"]})
    return out




def _stop(value: Any) -> tuple[str, ...] | None:
    """A row's stop strings: a list of strings, one string, or a JSON list in a string."""
    if value is None:
        return None
    if isinstance(value, str):
        if value.startswith("["):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise ValueError(f"stop is not a valid JSON list: {value!r}") from None
        else:
            value = [value]
    if not isinstance(value, list) or not all(isinstance(x, str) and x for x in value):
        raise ValueError(f"stop must be a list of non-empty strings, got {value!r}")
    return tuple(value)


def _mapping(value: Any, name: str) -> dict[str, Any]:
    """A mapping from a struct, an Arrow map (a list of pairs) or a JSON object in a string."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON ({e.msg})") from None
    if isinstance(value, list) and all(isinstance(x, tuple) and len(x) == 2 for x in value):
        value = dict(value)
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a mapping, got {value!r}")
    return value


def _lora(value: Any, names: tuple[str, ...]) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value not in names:
        known = ", ".join(names) or "none: give --lora-adapter NAME=PATH"
        raise ValueError(f"lora {value!r} is not an adapter of this run (adapters: {known})")
    return value


def _param(row: dict[str, Any], name: str, kind: type):
    v = row.get(name)
    if v is None:
        return None
    if isinstance(v, InvalidValue):
        raise ValueError(v.reason)
    if kind is int:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
            raise ValueError(f"{name} must be an integer, got {v!r}")
        lo, hi = int_range(RunConfig if name == "n" else SamplingParams, name)  # outside: the row, not the run
        if not lo <= v <= hi:
            raise ValueError(f"{name} must be in [{lo}, {hi}], got {v!r}")
        return int(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    return float(v)


class InputProcessor:
    """Applies the chat template, tokenizes, merges per-row parameters and the too_long policy."""

    def __init__(self, tokenizer, max_model_len: int, defaults: SamplingParams, too_long: str = "error",
                 run_seed: int = 0, chat_template_kwargs: dict[str, Any] | None = None, n: int = 1,
                 lora_names: tuple[str, ...] = (), prompt_format: str = "raw"):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.defaults = defaults
        self.too_long = too_long
        self.run_seed = run_seed
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.n = n
        self.lora_names = lora_names
        self.prompt_format = prompt_format  # chat | raw | auto (RunConfig.prompt_format)

    @classmethod
    def for_run(cls, cfg: RunConfig, tokenizer, max_model_len: int) -> InputProcessor:
        """The processor a run's rows go through (the runner's, and `batchgen estimate`'s count of them)."""
        return cls(tokenizer, max_model_len, cfg.sampling, cfg.too_long, cfg.engine_config.seed,
                   dict(cfg.chat_template_kwargs), cfg.n, tuple(name for name, _ in cfg.lora_adapters),
                   cfg.prompt_format)

    def process(self, row: dict[str, Any]) -> PreparedRow | RowError:
        rid = row["id"]
        try:
            overrides = {k: _param(row, k, t) for k, t in
                         (("max_tokens", int), ("temperature", float), ("top_p", float), ("top_k", int), ("seed", int),
                          ("logprobs", int), ("max_reasoning_tokens", int))}
            n = _param(row, "n", int) or self.n
            overrides["stop"] = _stop(row.get("stop"))
            overrides["structured"] = normalise_response_format(row.get("response_format"))
            overrides["lora"] = _lora(row.get("lora"), self.lora_names)
            sampling = replace(self.defaults, **{k: v for k, v in overrides.items() if v is not None})
            if sampling.seed is None:  # derived here, where rows become requests, so every engine gets the same
                sampling = replace(sampling, seed=derive_seed(self.run_seed, rid))
        except (ValueError, ConfigError) as e:
            return RowError(rid, f"invalid parameter: {e}", "validate")
        bad = next((v for v in row.values() if isinstance(v, InvalidValue)), None)
        if bad is not None:
            return RowError(rid, bad.reason, "validate")
        try:
            text = self._render(row)
            if not text.strip():
                raise ValueError("prompt is empty")
        except ValueError as e:
            return RowError(rid, str(e), "validate")
        except Exception as e:  # noqa: BLE001 - a template error is the row's problem, not the run's
            return RowError(rid, f"chat template failed: {e}", "validate")
        ids = self.tokenizer.encode(text)
        limit = self.max_model_len - 1  # at least one output token must fit
        if len(ids) > limit:
            if self.too_long == "error":
                return RowError(rid, f"prompt has {len(ids)} tokens, more than the {limit} that fit "
                                     f"max_model_len {self.max_model_len} (policy too_long=error)", "tokenize")
            return PreparedRow(rid, ids[-limit:], sampling, truncated_from=len(ids), n=n)  # keep the end, like vLLM
        return PreparedRow(rid, ids, sampling, n=n)

    def as_chat(self, prompt: str) -> bool:
        """Whether a plain prompt goes through the chat template (see RunConfig.prompt_format)."""
        if self.prompt_format == "auto":
            return self.tokenizer.has_chat_template and not self.tokenizer.is_rendered(prompt)
        return self.prompt_format == "chat"

    def _render(self, row: dict[str, Any]) -> str:
        """The prompt text: chat messages rendered with the model's template, or a `prompt` sent as
        prompt_format says (as a user message, or as is; never rendered twice). A `system` column adds
        a system turn (unless the row's messages start with one), which makes a plain prompt a chat;
        `chat_template_kwargs` (run, then row) reach the template when one is rendered."""
        kwargs = {**self.chat_template_kwargs, **_mapping(row.get("chat_template_kwargs"), "chat_template_kwargs")}
        system = row.get("system")
        if system is not None and not isinstance(system, str):
            raise ValueError(f"system must be a string, got {system!r}")
        if "messages" in row:
            messages = _messages(row["messages"])
        else:
            prompt = row.get("prompt")
            if prompt is None:
                raise ValueError("prompt is null")
            if isinstance(prompt, str) and not prompt.strip():
                raise ValueError("prompt is empty")  # a template around nothing is not a prompt
            if system is None and not self.as_chat(prompt):
                return prompt
            messages = [{"role": "user", "content": prompt}]
        if system is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system}] + messages
        return self.tokenizer.apply_chat_template(messages, **kwargs)
