"""Reasoning models (batchgen.engine.reasoning): the thought in `reasoning`, the answer in `text`,
`reasoning_tokens` beside the output count, and `--max-reasoning-tokens` closing a thought that runs
long. The markers come from the model's own chat template and vocabulary. The model here is a tiny
random-init Llama whose tokenizer holds `<think>` and `</think>` and whose template opens a thought
in the prompt unless enable_thinking is false (as DeepSeek-R1's and Qwen3's templates do): a random
model never closes a thought itself, so the budget is what ends one, and a row without a budget
runs to max_tokens inside its thought."""

import pytest

from batchgen.cli import main
from batchgen.engine.reasoning import Thought, ThinkMarkers, markers_of

from conftest import TOKENIZER_FILES, cli_args, read_run_table, write_prompts

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n"
            "{% endif %}{% endif %}")


def build_thinking_model(dest, real_model_dir, hidden: int = 64):
    """A random-init Llama with SmolLM2's tokenizer plus <think> and </think>, and TEMPLATE as its chat
    template; `hidden` 256 gives vLLM's CPU attention the head size it takes (64)."""
    import shutil

    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    for name in TOKENIZER_FILES:
        if (real_model_dir / name).is_file():
            shutil.copy(real_model_dir / name, dest / name)
    tok = Tokenizer.from_file(str(dest / "tokenizer.json"))
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok.save(str(dest / "tokenizer.json"))
    (dest / "chat_template.jinja").write_text(TEMPLATE)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden, intermediate_size=2 * hidden,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1,
                                 eos_token_id=2)).save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def thinking_model_dir(tmp_path_factory, real_model_dir):
    return build_thinking_model(tmp_path_factory.mktemp("thinking-llama"), real_model_dir)


def run_rows(tmp_path, model, run_id, *extra) -> dict:
    inp = write_prompts(tmp_path / f"{run_id}.parquet", ["What is two and two?", "Name a colour."], ids=["a", "b"])
    assert main([*cli_args(inp, tmp_path / "runs", model, run_id), "--max-tokens", "24", "--repetition-stop", "off",
                 *extra]) == 0
    return {r["id"]: r for r in read_run_table(tmp_path / "runs" / run_id, "requests").to_pylist()}


def test_the_budget_closes_the_thought_and_the_answer_follows(tmp_path, thinking_model_dir):
    from batchgen.model.tokenizer import Tokenizer

    tok = Tokenizer(thinking_model_dir)
    m = markers_of(tok.template_source, tok.token_id, tok.encode)
    assert m is not None and (m.start, m.end) == ("<think>", "</think>")
    rows = run_rows(tmp_path, thinking_model_dir, "budget", "--max-reasoning-tokens", "8")
    for r in rows.values():
        ids = r["output_token_ids"]
        close = len(m.close_ids)
        start = 8 - m.close_to_end  # the close ends its </think> on the budget's last token
        assert r["reasoning_cut"] and r["reasoning_tokens"] == 8 and ids[7] == m.end_id
        assert ids[start:start + close] == list(m.close_ids)  # what the budget wrote, as the model would
        assert r["output_tokens"] == 24 and r["reasoning"] and r["text"] == tok.decode(ids[r["reasoning_tokens"]:]).lstrip()
        assert "</think>" not in r["text"] and "</think>" not in r["reasoning"]


def test_without_a_budget_a_thought_cut_by_max_tokens_is_all_reasoning(tmp_path, thinking_model_dir):
    rows = run_rows(tmp_path, thinking_model_dir, "nobudget")
    for r in rows.values():
        assert r["reasoning_tokens"] == r["output_tokens"] == 24 and r["text"] == "" and r["reasoning_cut"] is False
        assert r["finish_reason"] == "length"


def test_thinking_off_in_the_template_leaves_every_output_answer(tmp_path, thinking_model_dir):
    rows = run_rows(tmp_path, thinking_model_dir, "off", "--chat-template-kwargs", "enable_thinking=false")
    for r in rows.values():
        assert r["reasoning"] is None and r["reasoning_tokens"] is None and r["text"]


def test_a_model_without_think_markers_has_no_reasoning(tmp_path, tiny_model_dir):
    rows = run_rows(tmp_path, tiny_model_dir, "plain", "--max-reasoning-tokens", "4")
    assert all(r["reasoning"] is None and r["output_tokens"] == 24 for r in rows.values())


def test_a_budget_per_row_wins(tmp_path, thinking_model_dir):
    inp = write_prompts(tmp_path / "in.parquet", ["q one", "q two"], ids=["a", "b"], max_reasoning_tokens=[4, None])
    assert main([*cli_args(inp, tmp_path / "runs", thinking_model_dir, "rows"), "--max-tokens", "24",
                 "--max-reasoning-tokens", "10", "--repetition-stop", "off"]) == 0
    rows = {r["id"]: r for r in read_run_table(tmp_path / "runs" / "rows", "requests").to_pylist()}
    from batchgen.model.tokenizer import Tokenizer

    tok = Tokenizer(thinking_model_dir)
    m = markers_of(tok.template_source, tok.token_id, tok.encode)
    assert (rows["a"]["reasoning_tokens"], rows["b"]["reasoning_tokens"]) == (4, 10)
    assert rows["a"]["output_token_ids"][3] == m.end_id


@pytest.mark.heavy  # starts vLLM
def test_vllm_keeps_the_thought_apart_and_closes_it_at_its_budget(tmp_path, real_model_dir):
    """The same split and budget under --engine vllm: vLLM's own thinking_token_budget (its
    reasoning_config set from the markers) closes the thought; batchgen splits it as on the native engine."""
    from conftest import skip_or_fail

    try:
        import vllm  # noqa: F401
    except ImportError as e:
        skip_or_fail(f"vLLM does not import here: {e}", "BATCHGEN_REQUIRE_VLLM")
    (tmp_path / "thinking-256").mkdir()
    model = build_thinking_model(tmp_path / "thinking-256", real_model_dir, hidden=256)
    rows = run_rows(tmp_path, model, "vllm", "--engine", "vllm", "--vllm-option", "enforce_eager=true",
                    "--max-reasoning-tokens", "8")
    from batchgen.model.tokenizer import Tokenizer

    tok = Tokenizer(model)
    end = tok.token_id("</think>")
    for r in rows.values():
        ids = r["output_token_ids"]
        assert ids.index(end) == 7  # closed where the budget ran out, as on the native engine
        assert r["reasoning_tokens"] == 8 and r["reasoning_cut"]
        assert r["reasoning"] is not None and "</think>" not in r["reasoning"]  # (a random model may write
        assert r["text"] == tok.decode(ids[8:]).lstrip()  # more of them in its answer)


def test_a_thought_closed_by_the_model_splits_there():
    """The split on token ids alone (the model closing its own thought, which a random model never does)."""
    m = ThinkMarkers("<think>", "</think>", 100, 101, (9, 101, 9))
    t = Thought(m, thinking=False)
    out = [100, 5, 6, 101, 9, 7, 8]
    for i, tok in enumerate(out):
        assert t.next_token(tok) == tok
        t.took(tok, i)
    assert t.split(out, lambda ids: " ".join(map(str, ids))) == ("5 6", "9 7 8", 4)
    plain = Thought(m, thinking=False)
    plain.took(7, 0)
    assert plain.split([7, 8], lambda ids: "x") == (None, "x", 0)
    assert m.in_thought_after([1, 100, 2]) and not m.in_thought_after([1, 100, 101, 2]) and not m.in_thought_after([1])


def test_the_report_counts_reasoning_against_answer(tmp_path, thinking_model_dir):
    from batchgen.report.queries import connect, run_query

    rows = run_rows(tmp_path, thinking_model_dir, "rep", "--max-reasoning-tokens", "8")
    (s,) = run_query(connect([str(tmp_path / "runs" / "rep")]), "dataset_summary").to_pylist()
    n = [r["reasoning_tokens"] for r in rows.values()]
    assert s["with_reasoning"] == 2 and s["reasoning_cut_by_budget"] == 2 and s["reasoning_unfinished"] == 0
    assert s["reasoning_tokens_mean"] == pytest.approx(sum(n) / 2)
    assert s["answer_tokens_mean"] == pytest.approx(sum(24 - k for k in n) / 2)
    rows = run_rows(tmp_path, thinking_model_dir, "rep2")  # no budget: every thought cut by max_tokens
    (s,) = run_query(connect([str(tmp_path / "runs" / "rep2")]), "dataset_summary").to_pylist()
    assert s["with_reasoning"] == s["reasoning_unfinished"] == 2 and s["reasoning_cut_by_budget"] == 0
