"""The edge: user-facing settings (YAML config, CLI flags, flow parameters) validated with pydantic,
then turned into the library's frozen RunConfig."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from batchgen.config import EngineConfig, RunConfig, SamplingParams
from batchgen.data.response_format import normalise_response_format


# The settings a job takes from the library's config dataclasses, in the order the CLI's help and the
# Prefect form show them: each field's default, bounds, choices, title and help are written once, on
# the dataclass (batchgen.config.setting), and read here.
RUN_FIELDS = ("run_id", "model", "engine", "prompt_format")
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "repetition_stop", "max_reasoning_tokens")
# every EngineConfig setting (the run seed sits with sampling's)
ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.metadata and f.name != "seed")
ERROR_FIELDS = ("max_error_rate", "error_rate_min_rows")
BUDGET_FIELDS = ("max_hours", "max_cost", "price_per_hour")
AS_LIST = {"stop"}  # a tuple in the library, a list in YAML, JSON and the form


def _from_config(cls, name: str) -> tuple[Any, Any]:
    """(annotation, pydantic Field) of one of `cls`'s fields, from its `setting` metadata."""
    f = next(x for x in dataclasses.fields(cls) if x.name == name)
    md = f.metadata
    annotation = typing.get_type_hints(cls)[name]
    if "choices" in md:
        annotation = Literal[md["choices"]]
    elif name in AS_LIST:
        annotation = list[typing.get_args(annotation)[0]]
    kw = {k: md[k] for k in ("ge", "gt", "le") if k in md}
    if "pattern" in md:
        kw["pattern"] = f"^(?:{md['pattern']})$"
    if f.default is not dataclasses.MISSING:
        kw["default"] = list(f.default) if name in AS_LIST else f.default
    return annotation, Field(title=md["title"], description=md.get("description") or None, **kw)


class _Settings(BaseModel):
    """Settings of one generation job: YAML config, CLI flags and the Prefect form (batchgen.settings_cli
    makes the flags from these fields)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    @model_validator(mode="before")
    @classmethod
    def _config_file(cls, data: Any) -> Any:
        """`config`: a run config file whose settings fill every one not given here; given mappings add to
        the file's (the CLI's flags over --config, a deployment's parameters over its config)."""
        if not isinstance(data, dict):
            return data
        try:
            merged = load_yaml(data["config"]) if data.get("config") else {}
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
        for key, value in data.items():
            old = merged.get(key)
            merged[key] = {**old, **value} if isinstance(value, dict) and isinstance(old, dict) else value
        if "input" not in merged:
            raise ValueError("no input: give --input PATH (or 'input:' in the config file)")
        return merged

    @field_validator("response_format", check_fields=False)
    @classmethod
    def _valid_response_format(cls, v: str | None) -> str | None:
        normalise_response_format(v)  # a ValueError names what is wrong
        return v

    def to_run_config(self) -> RunConfig:
        take = lambda names: {n: getattr(self, n) for n in names}  # noqa: E731
        return RunConfig(
            inputs=tuple(self.input), output_dir=self.output, **take(RUN_FIELDS + ("shard_size", "shard_by", "too_long", "n",
                                                                                   "output_format", "progress",
                                                                                   *ERROR_FIELDS, *BUDGET_FIELDS)),
            engine_config=EngineConfig(seed=self.seed, **take(ENGINE_FIELDS)),
            sampling=SamplingParams(stop=tuple(self.stop), ignore_eos=self.ignore_eos, logprobs=self.logprobs,
                                    structured=normalise_response_format(self.response_format),
                                    **take(SAMPLING_FIELDS)),
            engine_options=tuple(sorted(self.vllm.items())),
            chat_template_kwargs=tuple(sorted(self.chat_template_kwargs.items())),
            keep_columns=tuple(self.keep_columns), lora_adapters=tuple(sorted(self.lora_adapters.items())),
            reuse_from=tuple(self.reuse_from))


GenerateSettings = create_model(
    "GenerateSettings", __base__=_Settings, __module__=__name__,
    config=(str | None, Field(None, title="Run config file (YAML; its keys are these settings' names)",
                              description="a YAML run config (configs/*.yaml, its keys these settings' names) whose "
                                          "values fill every setting not given here")),
    input=(list[str], Field(..., min_length=1, title="Input",
                            description="Parquet or JSONL (rows, or OpenAI Batch request lines): file(s), directory "
                                        "or glob, local or a URI such as s3://bucket/prompts/")),
    output=(str, Field("runs", title="Output root",
                       description="each run is written to OUTPUT/RUN_ID/ (a local path or s3://bucket/prefix)")),
    **{n: _from_config(RunConfig, n) for n in RUN_FIELDS},
    **{n: _from_config(SamplingParams, n) for n in SAMPLING_FIELDS},
    seed=_from_config(EngineConfig, "seed"),
    **{n: _from_config(SamplingParams, n) for n in ("stop", "ignore_eos")},
    response_format=(str | None, Field(None, title="Response format (JSON)",
                                       description='as in the OpenAI API, e.g. {"type": "json_schema", "json_schema": '
                                                   '{"schema": {...}}}; also regex and choice; a row\'s '
                                                   'response_format column wins')),
    n=_from_config(RunConfig, "n"),
    logprobs=_from_config(SamplingParams, "logprobs"),
    chat_template_kwargs=(dict[str, Any], Field(default_factory=dict, title="Chat template variables",
                                                description="e.g. enable_thinking=false; a row's chat_template_kwargs "
                                                            "column adds to them")),
    keep_columns=(list[str], Field(default_factory=list, title="Input columns to keep",
                                   description="carried into requests/ and errors/, so outputs join back to their "
                                               "metadata")),
    reuse_from=(list[str], Field(default_factory=list, title="Reuse rows from earlier runs",
                                 description="run directories, directories of runs, globs or s3:// prefixes: rows "
                                             "whose request key (model, dtype, prompt tokens, sampling, seed) an "
                                             "earlier batch-invariant run committed are copied, not generated")),
    **{n: _from_config(EngineConfig, n) for n in ENGINE_FIELDS},
    **{n: _from_config(RunConfig, n) for n in ("shard_size", "shard_by", "too_long")},
    lora_adapters=(dict[str, str], Field(default_factory=dict, title="LoRA adapters (vLLM engine)",
                                         description="NAME=PATH of local PEFT adapter directories; a row's lora "
                                                     "column names the one it uses")),
    vllm=(dict[str, Any], Field(default_factory=dict, title="vLLM engine options",
                                description="tensor_parallel_size, gpu_memory_utilization, enable_prefix_caching, ...")),
    **{n: _from_config(RunConfig, n) for n in ("output_format", "progress", *ERROR_FIELDS, *BUDGET_FIELDS)},
)
GenerateSettings.__doc__ = "Settings of one generation job (fields from batchgen.config's dataclasses, and the edge's own)."


def load_yaml(path: str | Path) -> dict[str, Any]:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file not found: {p}")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{p}: a config must be a mapping of settings")
    if isinstance(data.get("input"), str):
        data["input"] = [data["input"]]
    return data
