"""One source per setting: the form's fields (CLI, YAML, Prefect) are derived from the library's config
dataclasses, so a default, bound or choice list cannot drift between the two. And every config the
project ships validates."""

import dataclasses
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from batchgen.config import ConfigError, EngineConfig, RunConfig, SamplingParams
from batchgen.settings import ENGINE_FIELDS, RUN_FIELDS, SAMPLING_FIELDS, GenerateSettings, load_yaml

REPO = Path(__file__).resolve().parents[1]
OWNERS = {**{n: RunConfig for n in RUN_FIELDS + ("shard_size", "too_long", "n", "output_format", "progress")},
          **{n: SamplingParams for n in SAMPLING_FIELDS + ("stop", "ignore_eos", "logprobs")},
          **{n: EngineConfig for n in ENGINE_FIELDS + ("seed",)}}


def _field(cls, name):
    return next(f for f in dataclasses.fields(cls) if f.name == name)


@pytest.mark.parametrize("name", sorted(OWNERS))
def test_form_field_is_the_config_fields(name):
    cls, form = OWNERS[name], GenerateSettings.model_fields[name]
    f = _field(cls, name)
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    assert form.default == (list(default) if isinstance(default, tuple) else default)
    assert form.title == f.metadata["title"]


def _bad_values(md):
    if "choices" in md:
        yield "no-such-choice"
    if "ge" in md:
        yield md["ge"] - 1
    if "gt" in md:
        yield md["gt"]
    if "le" in md:
        yield md["le"] + 1
    if "pattern" in md:
        yield "../x"


@pytest.mark.parametrize("name", sorted(n for n in OWNERS if list(_bad_values(_field(OWNERS[n], n).metadata))))
def test_the_library_and_the_form_refuse_the_same_values(name):
    """Each bound and choice list, written once on the dataclass, is enforced by both."""
    cls = OWNERS[name]
    bad = list(_bad_values(_field(cls, name).metadata))
    base = {"inputs": ("x",), "output_dir": "o"} if cls is RunConfig else {}
    for value in bad:
        with pytest.raises(ValidationError, match=name):
            GenerateSettings(input=["x"], **{name: value})
        with pytest.raises(ConfigError, match=name):
            cls(**base, **{name: value})


def test_defaults_make_the_library_defaults():
    cfg = GenerateSettings(input=["x"]).to_run_config()
    assert cfg.engine_config == EngineConfig() and cfg.sampling == SamplingParams()
    assert cfg == RunConfig(inputs=("x",), output_dir="runs")


def test_every_shipped_config_validates(monkeypatch):
    """configs/*.yaml and every deployment's parameters in prefect.yaml are valid settings."""
    monkeypatch.chdir(REPO)  # a deployment names its config file from the checkout, as its workers run
    for path in sorted((REPO / "configs").glob("*.yaml")):
        GenerateSettings(**load_yaml(path)).to_run_config()
    deployments = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    checked = 0
    for d in deployments:
        settings = (d.get("parameters") or {}).get("settings")
        if settings:
            GenerateSettings(**settings).to_run_config()
            checked += 1
    assert checked >= 1
    # the shipped GPU deployment runs the engine that has run on a GPU (see its note)
    nightly = next(d for d in deployments if d["name"] == "nightly")["parameters"]["settings"]
    resolved = GenerateSettings(**nightly)
    assert resolved.engine == "vllm"
    # its settings are the production config's, written there once, with only what it names over them
    production = GenerateSettings(**load_yaml(REPO / nightly["config"])).model_dump()
    own = {k for k in nightly if k != "config"}
    assert {k: v for k, v in resolved.model_dump().items() if k not in own | {"config"}} == \
        {k: v for k, v in production.items() if k not in own | {"config"}}
    assert own == {"input", "output", "reuse_from"}


def test_a_config_file_fills_what_is_not_given(tmp_path):
    """`config` (the CLI's --config, a deployment's or the form's field): the file's settings under the
    given ones; a given mapping adds to the file's; no input anywhere is one clear error."""
    cfg = tmp_path / "job.yaml"
    cfg.write_text("input: a.parquet\nmax_tokens: 64\ntemperature: 0.5\nvllm: {enforce_eager: true}\n")
    s = GenerateSettings(config=str(cfg), max_tokens=8, vllm={"max_num_seqs": 4})
    assert (s.input, s.max_tokens, s.temperature) == (["a.parquet"], 8, 0.5)
    assert s.vllm == {"enforce_eager": True, "max_num_seqs": 4}
    assert GenerateSettings(config=str(cfg), input=["b.parquet"]).input == ["b.parquet"]
    with pytest.raises(ValidationError, match="no input: give --input PATH"):
        GenerateSettings(max_tokens=8)
    with pytest.raises(ValidationError, match="config file not found"):
        GenerateSettings(config=str(tmp_path / "missing.yaml"), input=["x"])
