"""Model outputs against Hugging Face transformers, a reference nobody here wrote."""

import pytest
import torch

from batchgen.config import EngineConfig, SamplingParams
from batchgen.engine.native import NativeEngine
from batchgen.model.loader import ModelLoadError, load_model, read_model_config

from conftest import build_tiny_model


def hf_greedy(model_dir, prompts_ids, max_new):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outs = []
    for ids, n in zip(prompts_ids, max_new):
        g = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                        pad_token_id=0)
        outs.append(g[0, len(ids):].tolist())
    return outs


def engine_greedy(model_dir, prompts_ids, max_new, max_num_seqs, stats=None, **kw):
    kw.setdefault("max_num_batched_tokens", 4096)
    e = NativeEngine(model_dir, EngineConfig(dtype="float32", max_num_seqs=max_num_seqs, max_model_len=512, **kw))
    for i, (ids, n) in enumerate(zip(prompts_ids, max_new)):
        e.add(str(i), ids, SamplingParams(max_tokens=n, ignore_eos=True))
    out, max_concurrency = {}, 0
    while e.has_unfinished():
        r = e.step()
        max_concurrency = max(max_concurrency, r.num_running)
        if stats is not None:
            for k in ("num_preempted", "num_cached_tokens", "num_prefill_tokens"):
                stats[k] = stats.get(k, 0) + getattr(r, k)
            stats["max_step_tokens"] = max(stats.get("max_step_tokens", 0), r.num_prefill_tokens + r.num_decode_tokens)
        for f in r.finished:
            out[int(f.request_id)] = f.output_token_ids
    return [out[i] for i in range(len(prompts_ids))], max_concurrency


FAMILIES = ["llama", "qwen2", "llama3", "qwen3", "gemma2"]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_tiny_model_logits_match_hf(tmp_path, real_model_dir, model_type):
    from transformers import AutoModelForCausalLM

    d = build_tiny_model(tmp_path, real_model_dir, model_type)
    ours = load_model(d, max_positions=64)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    tokens = torch.randint(0, 49152, (3, 17))
    with torch.no_grad():
        ref = hf(tokens).logits  # [3, 17, V]
    got = ours.prefill(tokens, torch.tensor([16, 16, 16]))
    torch.testing.assert_close(got, ref[:, -1], atol=1e-4, rtol=1e-4)


def test_tiny_model_continuous_batching_matches_hf(tiny_model_dir):
    prompts = [list(range(100 + 7 * i, 100 + 7 * i + 3 + 5 * i)) for i in range(7)]
    max_new = [5, 12, 3, 9, 16, 1, 7]
    ref = hf_greedy(tiny_model_dir, prompts, max_new)
    got, concurrency = engine_greedy(tiny_model_dir, prompts, max_new, max_num_seqs=3)
    assert concurrency == 3
    assert got == ref


@pytest.mark.parametrize("model_type", ["llama3", "qwen3", "gemma2"])
def test_each_family_generates_hfs_greedy_tokens_through_the_paged_engine(tmp_path, real_model_dir, model_type):
    d = build_tiny_model(tmp_path, real_model_dir, model_type, seed=3)
    prompts = [list(range(300 + 11 * i, 300 + 11 * i + 5 + 9 * i)) for i in range(4)]
    max_new = [20, 9, 14, 5]  # positions past the 64 of the original context: the scaled RoPE regime
    ref = hf_greedy(d, prompts, max_new)
    got, _ = engine_greedy(d, prompts, max_new, max_num_seqs=2, max_num_batched_tokens=16, block_size=8)
    assert got == ref


TINY_PROMPTS = [list(range(100 + 7 * i, 100 + 7 * i + 3 + 5 * i)) for i in range(7)]
TINY_MAX_NEW = [5, 12, 3, 9, 16, 1, 7]


def test_tiny_model_matches_hf_with_preemption_forced_by_a_tiny_pool(tiny_model_dir):
    ref = hf_greedy(tiny_model_dir, TINY_PROMPTS, TINY_MAX_NEW)
    stats = {}
    # 6 blocks of 8 positions: the longest request (33 prompt + 16 new = 49 positions) fits alone,
    # but never beside the others, so running requests are preempted and recomputed
    got, _ = engine_greedy(tiny_model_dir, TINY_PROMPTS, TINY_MAX_NEW, max_num_seqs=4, kv_cache_tokens=48,
                           block_size=8, stats=stats)
    assert stats["num_preempted"] > 0
    assert got == ref


def test_tiny_model_matches_hf_with_chunked_prefill(tiny_model_dir):
    ref = hf_greedy(tiny_model_dir, TINY_PROMPTS, TINY_MAX_NEW)
    stats = {}
    got, _ = engine_greedy(tiny_model_dir, TINY_PROMPTS, TINY_MAX_NEW, max_num_seqs=3, max_num_batched_tokens=7,
                           block_size=4, stats=stats)
    assert stats["max_step_tokens"] <= 7  # prompts of up to 33 tokens went in chunks beside decode tokens
    assert got == ref


def test_tiny_model_matches_hf_with_prefix_cache_hits(tiny_model_dir):
    system = list(range(1000, 1045))  # a shared 45-token prefix: 5 full blocks of 8
    prompts = [system + list(range(2000 + 10 * i, 2000 + 10 * i + 2 + i)) for i in range(5)]
    max_new = [6, 3, 8, 5, 4]
    ref = hf_greedy(tiny_model_dir, prompts, max_new)
    stats = {}
    got, _ = engine_greedy(tiny_model_dir, prompts, max_new, max_num_seqs=1, block_size=8, stats=stats)
    assert stats["num_cached_tokens"] == 4 * 40  # every row after the first reused 5 cached blocks
    assert got == ref
    together = {}  # all five admitted in one step: the later ones read blocks the first writes in that pass
    got, concurrency = engine_greedy(tiny_model_dir, prompts, max_new, max_num_seqs=5, block_size=8, stats=together)
    assert concurrency == 5 and together["num_cached_tokens"] == 4 * 40
    assert got == ref
    off = {}
    engine_greedy(tiny_model_dir, prompts, max_new, max_num_seqs=1, block_size=8, stats=off,
                  enable_prefix_caching=False)
    assert off["num_cached_tokens"] == 0 and off["num_prefill_tokens"] == stats["num_prefill_tokens"] + 160


def test_no_cache_mode_gives_the_cached_tokens(tiny_model_dir):
    prompts = [list(range(200, 211)), list(range(300, 305))]
    cached, _ = engine_greedy(tiny_model_dir, prompts, [10, 6], max_num_seqs=2)
    recomputed, _ = engine_greedy(tiny_model_dir, prompts, [10, 6], max_num_seqs=2, enable_kv_cache=False)
    chunked, _ = engine_greedy(tiny_model_dir, prompts, [10, 6], max_num_seqs=2, enable_kv_cache=False,
                               max_num_batched_tokens=4)  # prompt chunks that sample nothing yet
    assert cached == recomputed == chunked


@pytest.fixture(scope="module")
def real_prompt_ids(real_model_dir):
    from batchgen.model.tokenizer import Tokenizer

    import pyarrow.parquet as pq
    from conftest import TEST_DATA

    tok = Tokenizer(real_model_dir)
    rows = pq.read_table(TEST_DATA / "alpaca_seed_prompts.parquet").to_pylist()[:10]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": r["prompt"]}])) for r in rows]


@pytest.mark.slow
def test_real_model_greedy_matches_hf_at_batch_1_and_continuous_batching(real_model_dir, real_prompt_ids):
    max_new = [24, 8, 16, 24, 4, 12, 20, 8, 16, 24]
    ref = hf_greedy(real_model_dir, real_prompt_ids, max_new)
    one, _ = engine_greedy(real_model_dir, real_prompt_ids, max_new, max_num_seqs=1)
    many, concurrency = engine_greedy(real_model_dir, real_prompt_ids, max_new, max_num_seqs=4)
    assert concurrency == 4  # sequences joined and left mid-run
    assert one == ref
    assert many == ref
    # the same with oneDNN's fp32 matmul, where the default is batchgen's gemv kernel (batchgen.model.gemv)
    onednn, _ = engine_greedy(real_model_dir, real_prompt_ids, max_new, max_num_seqs=4, fp32_kernel="onednn")
    assert onednn == ref
    stats = {}
    packed, _ = engine_greedy(real_model_dir, real_prompt_ids, max_new, max_num_seqs=8, kv_cache_tokens=256,
                              max_num_batched_tokens=48, stats=stats)
    assert stats["num_preempted"] > 0 and stats["max_step_tokens"] <= 48
    assert packed == ref  # preempted, recomputed and chunked, still HF's tokens


def test_chat_template_matches_transformers(real_model_dir):
    from transformers import AutoTokenizer

    from batchgen.model.tokenizer import Tokenizer

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there, ünïcode ✓"}]
    ours = Tokenizer(real_model_dir)
    ref = AutoTokenizer.from_pretrained(real_model_dir).apply_chat_template(msgs, add_generation_prompt=True,
                                                                           tokenize=False)
    assert ours.apply_chat_template(msgs) == ref


def test_unsupported_architecture_and_missing_files_are_named(tmp_path, tiny_model_dir):
    import json
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="does not implement architecture 'gpt2'.*Use --engine vllm"):
        read_model_config(d)
    yarn = {**cfg, "model_type": "qwen2", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    (d / "config.json").write_text(json.dumps(yarn))
    with pytest.raises(ModelLoadError, match="does not implement rope_type 'yarn'.*Use --engine vllm"):
        read_model_config(d)
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "llama", "hidden_act": "relu"}))
    with pytest.raises(ModelLoadError, match="does not implement activation 'relu'; use --engine vllm"):
        read_model_config(d)
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="missing weights"):
        load_model(d)
    with pytest.raises(ModelLoadError, match="model directory not found"):
        read_model_config(tmp_path / "nope")


def test_logprobs_are_hfs_raw_log_softmax(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    prompt, n = list(range(500, 512)), 6
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    g = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                    output_logits=True, return_dict_in_generate=True)
    ref = [torch.log_softmax(step[0].float(), -1) for step in g.logits]  # raw logits of each new token
    e = NativeEngine(tiny_model_dir, EngineConfig(dtype="float32", max_num_seqs=2, max_model_len=128))
    e.add("lp", prompt, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=3))
    e.add("none", prompt, SamplingParams(max_tokens=n, ignore_eos=True))  # same batch, no logprobs
    got = {"lp": [], "none": []}
    while e.has_unfinished():
        r = e.step()
        for rid, lp, top in zip(r.token_request_ids, r.token_logprobs, r.token_top_logprobs):
            got[rid].append((lp, top))
    assert got["none"] == [(None, None)] * n
    tokens = g.sequences[0, len(prompt):].tolist()
    for step, (tok, (lp, top)) in enumerate(zip(tokens, got["lp"])):
        assert lp == pytest.approx(ref[step][tok].item(), abs=1e-4)
        ref_top = ref[step].topk(3)
        assert [t for t, _ in top] == ref_top.indices.tolist()
        assert [v for _, v in top] == pytest.approx(ref_top.values.tolist(), abs=1e-4)
        assert top[0] == (tok, pytest.approx(lp))  # greedy picks the top one


def test_seeded_samples_are_the_same_with_and_without_preemption(tiny_model_dir):
    def sampled(**kw):
        e = NativeEngine(tiny_model_dir, EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=512, block_size=8, **kw))
        for i, (ids, n) in enumerate(zip(TINY_PROMPTS, TINY_MAX_NEW)):
            e.add(str(i), ids, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.9, top_p=0.9, seed=100 + i))
        out, preempted = {}, 0
        while e.has_unfinished():
            r = e.step()
            preempted += r.num_preempted
            out.update({f.request_id: f.output_token_ids for f in r.finished})
        return out, preempted

    roomy, none = sampled()
    tight, some = sampled(kv_cache_tokens=48, max_num_batched_tokens=8)
    assert none == 0 and some > 0
    assert tight == roomy  # the noise is a function of (seed, token index), not of when a token was computed
