"""What a newcomer meets first: plain questions answered by a chat model, the run's end saying where
the outputs are, help grouped with its defaults, and argument errors in one line with the fix."""

import duckdb
import pytest

from batchgen.cli import main, parse, where_outputs_are
from batchgen.data.prompts import InputProcessor
from batchgen.config import SamplingParams
from batchgen.model.tokenizer import Tokenizer
from batchgen.outcome import RunSummary

from conftest import cli_args, write_prompts


def rendered(tokenizer, fmt: str, prompt: str) -> str:
    row = InputProcessor(tokenizer, 512, SamplingParams(), prompt_format=fmt).process({"id": "a", "prompt": prompt})
    return tokenizer._tok.decode(row.prompt_token_ids, skip_special_tokens=False)


def test_a_plain_prompt_goes_to_a_chat_model_as_a_user_message_and_is_never_rendered_twice(tiny_model_dir):
    tok = Tokenizer(tiny_model_dir)
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert rendered(tok, "auto", "What is the capital of France?") == chat  # the default: as dataset tools send it
    assert rendered(tok, "chat", "What is the capital of France?") == chat
    assert rendered(tok, "raw", "What is the capital of France?") == "What is the capital of France?"  # vLLM's generate
    assert rendered(tok, "auto", chat) == chat  # already rendered: as is, not wrapped again
    assert tok.is_rendered(chat) and not tok.is_rendered("What is <b>bold</b>?")


@pytest.mark.slow
def test_plain_questions_get_answers_and_the_run_says_where_they_are(tmp_path, real_model_dir, capsys):
    """The README's first run: plain questions in a `prompt` column, default flags, the default instruct
    model: every row answered, the prompt format said before the run, and where to look after it."""
    questions = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?",
                 "Which planet do we live on?", "What do bees make?", "What is the opposite of hot?"]
    inp = write_prompts(tmp_path / "questions.parquet", questions)
    assert main(["generate", "--input", str(inp), "--output", str(tmp_path / "runs"), "--run-id", "first",
                 "--max-tokens", "16", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "plain prompts sent as user messages through the model's chat template" in err
    run = tmp_path / "runs" / "first"
    assert f"outputs: {run / 'requests'}/" in out and f"batchgen report {run}" in out and "warning" not in err
    # the three lines of DuckDB the run prints, as a person pastes them
    texts = duckdb.sql(f"select text from read_parquet('{run / 'requests'}/**/*.parquet')").fetchall()
    assert len(texts) == 6 and all(t.strip() for (t,) in texts), texts
    assert any("Paris" in t for (t,) in texts)


def test_outputs_that_look_broken_are_named_at_the_end():
    def summary(**kw):
        return RunSummary("runs/r", 10, 10, 0, 1, False, 10, 1.0, **kw)

    lines = summary(generated=10, empty=6, most_common=6).warnings()
    assert len(lines) == 1 and "6 of 10 outputs are empty" in lines[0] and "--prompt-format chat" in lines[0]
    lines = summary(generated=10, empty=0, most_common=7).warnings()
    assert len(lines) == 1 and "7 of 10 outputs, each for a different prompt, share one text" in lines[0]
    assert summary(generated=10, empty=1, most_common=2).warnings() == []
    ends = where_outputs_are("runs/r", "openai-batch")
    assert "runs/r/batch_output.jsonl" in ends and "batchgen report runs/r" in ends and "read_parquet(" in ends


def test_help_groups_the_flags_and_shows_their_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    groups = ["input and output:", "model and prompts:", "sampling:", "batching and memory:", "engine internals"]
    assert all(g in text for g in groups) and [text.index(g) for g in groups] == sorted(text.index(g) for g in groups)
    assert "(default 128)" in text and "(default auto)" in text and "(required)" in text
    assert text.index("--max-tokens") < text.index("engine internals") < text.index("--fp32-kernel")
    assert len(text.splitlines()) < 120


@pytest.mark.parametrize("argv, says", [
    (["generate", "--input", "x", "--max-tokns", "24"],
     "batchgen generate: error: unrecognized argument: --max-tokns 24 (did you mean --max-tokens?)"),
    (["generate", "--input", "x", "--max-token", "24"],  # no silent prefix match
     "batchgen generate: error: unrecognized argument: --max-token 24 (did you mean --max-tokens?)"),
    (["generate", "--input", "x", "--dtype", "fp32"],
     "batchgen generate: error: argument --dtype: invalid choice: 'fp32' (choose from 'auto', 'float32', "
     "'bfloat16', 'float16'); did you mean 'float32'?"),
    (["bench", "--batchs", "3"], "batchgen bench: error: unrecognized argument: --batchs 3 (did you mean --batches?)"),
])
def test_an_argument_error_is_one_line_naming_the_fix(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith(says), err


def test_a_changed_setting_on_resume_is_named_with_both_values(tmp_path, tiny_model_dir, capsys):
    inp = write_prompts(tmp_path / "in.parquet", ["hello", "there"])
    assert main(cli_args(inp, tmp_path / "runs", tiny_model_dir, "r")) == 0
    capsys.readouterr()
    assert main([*cli_args(inp, tmp_path / "runs", tiny_model_dir, "r"), "--max-tokens", "5",
                 "--prompt-format", "raw"]) == 2
    err = capsys.readouterr().err
    assert "--max-tokens 4, now 5" in err and "prompt format (--prompt-format) ('auto', now 'raw')" in err
