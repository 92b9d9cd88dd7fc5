"""Per-row request features on the native engine: stop lists, a system column, chat-template
variables, input columns kept beside the outputs, and seeds derived where rows become requests."""

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.cli import main
from batchgen.config import SamplingParams, derive_seed
from batchgen.data.prompts import InputProcessor, PreparedRow, RowError
from batchgen.model.tokenizer import Tokenizer

from conftest import cli_args, read_run_table

THINKING_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking %}<think>{% endif %}{% endif %}")


@pytest.fixture
def thinking_model(tmp_path, tiny_model_dir):
    d = tmp_path / "thinking"
    shutil.copytree(tiny_model_dir, d)
    (d / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return d


def processor(model_dir, **kw):
    return InputProcessor(Tokenizer(model_dir), 512, SamplingParams(stop=("RUN",)), **kw)


def text_of(p: PreparedRow, model_dir) -> str:
    return Tokenizer(model_dir).decode(p.prompt_token_ids)


def test_system_column_and_template_variables_shape_the_prompt(thinking_model):
    proc = processor(thinking_model, chat_template_kwargs={"enable_thinking": False})
    plain = proc.process({"id": "a", "prompt": "hi"})
    assert text_of(plain, thinking_model) == "hi"  # a plain prompt is used as it is
    sys_row = proc.process({"id": "b", "prompt": "hi", "system": "be brief"})
    assert text_of(sys_row, thinking_model) == "<|system|>be brief\n<|user|>hi\n<|assistant|>"
    chat = [{"role": "user", "content": "hi"}]
    assert text_of(proc.process({"id": "c0", "messages": chat}), thinking_model).endswith("<|assistant|>")
    think = proc.process({"id": "c", "messages": chat, "chat_template_kwargs": json.dumps({"enable_thinking": True})})
    assert text_of(think, thinking_model).endswith("<|assistant|><think>")  # the row's variables win
    own = proc.process({"id": "d", "messages": [{"role": "system", "content": "mine"}, {"role": "user", "content": "x"}],
                        "system": "ignored"})
    assert text_of(own, thinking_model).startswith("<|system|>mine\n<|user|>x")  # the row's own system turn stays
    bad = proc.process({"id": "e", "prompt": "hi", "chat_template_kwargs": "{oops"})
    assert isinstance(bad, RowError) and "chat_template_kwargs is not valid JSON" in bad.error


def test_per_row_stop_replaces_the_run_stop_and_seeds_are_derived_here(tiny_model_dir):
    proc = processor(tiny_model_dir, run_seed=7)
    assert proc.process({"id": "a", "prompt": "x"}).sampling.stop == ("RUN",)
    assert proc.process({"id": "b", "prompt": "x", "stop": ["A", "B"]}).sampling.stop == ("A", "B")
    assert proc.process({"id": "c", "prompt": "x", "stop": '["\\n\\n"]'}).sampling.stop == ("\n\n",)
    bad = proc.process({"id": "d", "prompt": "x", "stop": ["", "B"]})
    assert isinstance(bad, RowError) and "stop must be a list of non-empty strings" in bad.error
    assert proc.process({"id": "e", "prompt": "x"}).sampling.seed == derive_seed(7, "e")
    assert proc.process({"id": "f", "prompt": "x", "seed": 3}).sampling.seed == 3


def test_features_through_the_cli_with_kept_columns(tmp_path, tiny_model_dir):
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({
        "id": ["a", "b", "c", "bad"],
        "prompt": ["one two", "three four", "five six", "seven"],
        "stop": pa.array([None, ["zzz"], None, [""]], pa.list_(pa.string())),
        "system": [None, "You answer in French.", None, None],
        "source": ["wiki", "news", "wiki", "forum"],
        "weight": pa.array([0.5, 1.5, 2.5, 3.5], pa.float32()),
    }), inp)
    out = tmp_path / "runs"
    # raw: a plain prompt as is, so the system turn is what makes a row a chat
    assert main(cli_args(inp, out, tiny_model_dir, "r", "--keep-columns", "source", "weight", "--prompt-format",
                         "raw")) == 0
    req = {r["id"]: r for r in read_run_table(out / "r", "requests").to_pylist()}
    (err,) = read_run_table(out / "r", "errors").to_pylist()
    assert {k: (r["source"], r["weight"]) for k, r in req.items()} == {"a": ("wiki", 0.5), "b": ("news", 1.5),
                                                                      "c": ("wiki", 2.5)}
    assert err["id"] == "bad" and err["source"] == "forum" and "stop must be" in err["error"]
    assert {k: r["prompt"] for k, r in req.items()} == {"a": "one two", "b": "three four", "c": "five six"}
    assert err["prompt"] == "seven"  # beside the answer, or beside the error
    assert req["b"]["prompt_tokens"] > req["a"]["prompt_tokens"] + 5  # the system turn and template were added
    assert read_run_table(out / "r", "requests").schema.field("weight").type == pa.float64()  # widened, as every file of the input is


def test_the_prompt_as_given_beside_each_answer():
    """requests/ and errors/ carry each row's prompt: the prompt column, or a chat's last user turn."""
    from batchgen.data.writer import prompt_as_given

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Capital of France?"}]
    assert prompt_as_given({"id": "a", "prompt": "plain"}) == "plain"
    assert prompt_as_given({"id": "b", "messages": chat}) == "Capital of France?"
    assert prompt_as_given({"id": "c", "messages": json.dumps(chat)}) == "Capital of France?"
    assert prompt_as_given({"id": "d", "messages": "not json"}) is None
    assert prompt_as_given({"id": "e", "messages": [{"role": "system", "content": "x"}]}) is None


def test_keep_columns_that_are_missing_or_clash_are_whole_input_errors(tmp_path, tiny_model_dir, capsys):
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["x"], "text": ["y"]}), inp)
    assert main(cli_args(inp, tmp_path / "runs", tiny_model_dir, "r", "--keep-columns", "nope")) == 2
    assert "--keep-columns names 'nope', which the input does not have" in capsys.readouterr().err
    assert main(cli_args(inp, tmp_path / "runs", tiny_model_dir, "r", "--keep-columns", "text")) == 2
    assert "--keep-columns text: an output column has that name" in capsys.readouterr().err


def test_every_setting_has_exactly_one_cli_flag():
    """The CLI is made from the settings model: no field without a flag, no flag without a field."""
    import argparse

    from batchgen.settings import GenerateSettings
    from batchgen.settings_cli import add_settings_flags

    p = argparse.ArgumentParser()
    add_settings_flags(p)
    dests = [a.dest for a in p._actions if a.dest != "help"]
    assert sorted(dests) == sorted(GenerateSettings.model_fields)


def test_logprobs_land_in_tokens_per_run_and_per_row(tmp_path, tiny_model_dir):
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["run", "zero", "five"], "prompt": ["a b c", "d e f", "g h i"],
                             "logprobs": pa.array([None, 0, 5], pa.int64())}), inp)
    out = tmp_path / "runs"
    assert main(cli_args(inp, out, tiny_model_dir, "r", "--logprobs", "2")) == 0
    toks = read_run_table(out / "r", "tokens").to_pylist()
    by = {}
    for t in toks:
        by.setdefault(t["request_id"], []).append(t)
    assert all(t["logprob"] is not None and t["logprob"] <= 0 for t in toks)
    assert all(len(t["top_logprobs"]) == 2 for t in by["run"])
    assert all(t["top_logprobs"] is None for t in by["zero"])  # 0: the chosen token's only
    assert all(len(t["top_logprobs"]) == 5 for t in by["five"])
    for t in toks:  # greedy: the chosen token is the most likely one
        if t["top_logprobs"]:
            assert t["top_logprobs"][0]["token_id"] == t["token_id"]
    assert main(cli_args(inp, out, tiny_model_dir, "off")) == 0
    off = {t["request_id"]: t for t in read_run_table(out / "off", "tokens").to_pylist()}
    assert off["run"]["logprob"] is None and off["five"]["top_logprobs"] is not None  # a row's column still asks


def test_n_samples_are_rows_with_sample_index_and_their_own_seeds(tmp_path, tiny_model_dir):
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "bad"], "prompt": ["one two", "three four", "  "],
                             "n": pa.array([None, 1, None], pa.int64())}), inp)
    out = tmp_path / "runs"
    assert main(cli_args(inp, out, tiny_model_dir, "r", "--n", "3", "--temperature", "1.0", "--max-tokens", "6")) == 0
    req = read_run_table(out / "r", "requests").to_pylist()
    assert sorted((r["id"], r["sample_index"], r["num_samples"]) for r in req) == [
        ("a", 0, 3), ("a", 1, 3), ("a", 2, 3), ("b", 0, 1)]
    a = [r for r in req if r["id"] == "a"]
    assert len({r["seed"] for r in a}) == 3 and len({tuple(r["output_token_ids"]) for r in a}) > 1
    (err,) = read_run_table(out / "r", "errors").to_pylist()
    assert err["id"] == "bad" and err["sample_index"] is None  # one error row covers every sample of the row
    toks = read_run_table(out / "r", "tokens").to_pylist()
    for r in req:
        mine = [t for t in toks if (t["request_id"], t["sample_index"]) == (r["id"], r["sample_index"])]
        assert [t["token_id"] for t in sorted(mine, key=lambda t: t["token_index"])] == r["output_token_ids"]
    assert main(cli_args(inp, out, tiny_model_dir, "again", "--n", "3", "--temperature", "1.0", "--max-tokens", "6")) == 0
    again = {(r["id"], r["sample_index"]): r["output_token_ids"] for r in read_run_table(out / "again", "requests").to_pylist()}
    assert again == {(r["id"], r["sample_index"]): r["output_token_ids"] for r in req}  # seeded: the same samples


def test_the_run_contract_counts_id_and_sample_pairs():
    from batchgen.data.run_dir import exactly_once_problems
    from batchgen.data.writer import SCHEMAS

    def t(name, rows):
        return pa.Table.from_pylist([dict(zip(("id", "sample_index", "num_samples"), r)) for r in rows],
                                    schema=SCHEMAS[name])

    ids = pa.array(["x", "y"])
    ok = exactly_once_problems(t("requests", [("x", 0, 2), ("y", 0, 1)]), t("errors", [("x", 1, 2)]), ids)
    assert ok is None  # sample 1 of x failed alone; the rest were generated
    assert exactly_once_problems(t("requests", [("y", 0, 1)]), t("errors", [("x", None, None)]), ids) is None
    missing = exactly_once_problems(t("requests", [("x", 0, 2), ("y", 0, 1)]), t("errors", []), ids)
    assert "1 ids do not have each of their samples exactly once (e.g. 'x')" in missing
    twice = exactly_once_problems(t("requests", [("x", 0, 1), ("x", 0, 1), ("y", 0, 1)]), t("errors", []), ids)
    assert "1 (id, sample) pairs appear more than once" in twice
    both = exactly_once_problems(t("requests", [("x", 0, 1), ("y", 0, 1)]), t("errors", [("x", None, None)]), ids)
    assert both is not None and "'x'" in both


SCHEMA = {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                           "sarcastic": {"type": "boolean"}},
          "required": ["sentiment", "sarcastic"], "additionalProperties": False}


def response_format(schema=SCHEMA):
    return json.dumps({"type": "json_schema", "json_schema": {"name": "label", "schema": schema}})


def test_structured_output_per_row_on_the_native_engine(tmp_path, tiny_model_dir):
    """A random-weight model still writes valid output: the grammar leaves it no other token."""
    import jsonschema

    inp = tmp_path / "in.parquet"
    rows = [("js", response_format()), ("obj", json.dumps({"type": "json_object"})),
            ("re", json.dumps({"type": "regex", "regex": "[0-9]{3}-[a-z]{2}"})),
            ("ch", json.dumps({"type": "choice", "choice": ["alpha", "beta gamma"]})),
            ("free", None), ("bad", json.dumps({"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}})),
            ("worse", "{not json")]
    pq.write_table(pa.table({"id": [r[0] for r in rows], "prompt": [f"label this: {r[0]}" for r in rows],
                             "response_format": [r[1] for r in rows]}), inp)
    out = tmp_path / "runs"
    assert main(cli_args(inp, out, tiny_model_dir, "r", "--max-tokens", "40", "--temperature", "0.9")) == 0
    req = {r["id"]: r for r in read_run_table(out / "r", "requests").to_pylist()}
    errors = {e["id"]: e["error"] for e in read_run_table(out / "r", "errors").to_pylist()}
    jsonschema.validate(json.loads(req["js"]["text"]), SCHEMA)
    assert req["js"]["finish_reason"] == "stop"
    # any JSON: a random model may keep a string open until max_tokens; what stopped must parse
    assert req["obj"]["finish_reason"] in ("stop", "length")
    if req["obj"]["finish_reason"] == "stop":
        assert isinstance(json.loads(req["obj"]["text"]), (dict, list, str, int, float, bool, type(None)))
    else:
        assert req["obj"]["text"].lstrip().startswith("{")  # an object was begun
    import re

    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", req["re"]["text"])
    assert req["ch"]["text"] in ("alpha", "beta gamma")
    assert "free" in req  # no constraint
    assert "invalid response_format" in errors["bad"] and "response_format is not valid JSON" in errors["worse"]
