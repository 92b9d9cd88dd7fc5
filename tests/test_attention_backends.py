"""The FlashInfer path's plan (page indices, last-page lengths, causal alignment) checked on the CPU
against a test double of flashinfer that computes exactly what FlashInfer's batch prefill kernel
is documented to compute. The real kernel runs only on CUDA; this pins our side of the contract."""

import sys
import types

import pytest
import torch

from batchgen.config import EngineConfig, SamplingParams
from batchgen.engine.native import NativeEngine


class FakeBatchPrefillWithPagedKVCacheWrapper:
    """Test double: FlashInfer's BatchPrefillWithPagedKVCacheWrapper semantics, one request at a time."""

    def __init__(self, workspace, kv_layout="NHD"):
        assert kv_layout == "NHD"
        self.plans = 0

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, causal=False, sm_scale=None, window_left=-1, logits_soft_cap=0.0, q_data_type=None,
             kv_data_type=None):
        self.args = (qo_indptr.tolist(), kv_indptr.tolist(), kv_indices.tolist(), last_page_len.tolist())
        self.heads, self.page_size, self.causal, self.sm_scale = (num_qo_heads, num_kv_heads), page_size, causal, sm_scale
        self.window_left, self.soft_cap = window_left, logits_soft_cap
        self.plans += 1

    def run(self, q, kv):
        k_cache, v_cache = kv  # [pages, page_size, Hkv, D]
        qo, kvp, idx, last = self.args
        out = torch.empty_like(q)
        for i in range(len(qo) - 1):
            pages = idx[kvp[i]:kvp[i + 1]]
            kv_len = (len(pages) - 1) * self.page_size + last[i]
            k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:kv_len].transpose(0, 1)  # [Hkv, S, D]
            v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:kv_len].transpose(0, 1)
            qi = q[qo[i]:qo[i + 1]].transpose(0, 1)  # [H, q_len, D]
            q_len = qi.shape[1]
            # causal, aligned to the end: query j sits at position kv_len - q_len + j
            q_pos = (kv_len - q_len + torch.arange(q_len))[:, None]
            mask = torch.arange(kv_len)[None, :] <= q_pos
            if self.window_left >= 0:
                mask &= torch.arange(kv_len)[None, :] >= q_pos - self.window_left
            g = qi.shape[0] // k.shape[0]
            s = torch.matmul(qi, k.repeat_interleave(g, 0).transpose(-1, -2)).float() * self.sm_scale
            if self.soft_cap:
                s = torch.tanh(s / self.soft_cap) * self.soft_cap
            o = torch.matmul(s.masked_fill(~mask, float("-inf")).softmax(-1), v.repeat_interleave(g, 0))
            out[qo[i]:qo[i + 1]] = o.transpose(0, 1)
        return out


def fake_flashinfer(monkeypatch):
    mod = types.ModuleType("flashinfer")
    mod.BatchPrefillWithPagedKVCacheWrapper = FakeBatchPrefillWithPagedKVCacheWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    sys.modules.pop("batchgen.engine.attention_flashinfer", None)


def greedy(model_dir, backend, **kw):
    e = NativeEngine(model_dir, EngineConfig(dtype="float32", max_num_seqs=3, max_model_len=256, block_size=8, kv_cache_tokens=56,
                                             max_num_batched_tokens=11, attention_backend=backend, **kw))
    prompts = [list(range(100 + 9 * i, 100 + 9 * i + 4 + 6 * i)) for i in range(5)]
    for i, p in enumerate(prompts):
        e.add(str(i), p, SamplingParams(max_tokens=9, ignore_eos=True))
    out, preempted = {}, 0
    while e.has_unfinished():
        r = e.step()
        preempted += r.num_preempted
        out.update({f.request_id: f.output_token_ids for f in r.finished})
    return out, preempted, e


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])  # gemma2: a sliding window and soft caps too
def test_flashinfer_plan_gives_the_torch_paths_tokens(monkeypatch, tmp_path, real_model_dir, model_type):
    from conftest import build_tiny_model

    model_dir = build_tiny_model(tmp_path, real_model_dir, model_type)
    ref, _, torch_engine = greedy(model_dir, "torch")
    assert torch_engine.runner.kv.layout == "HND"
    fake_flashinfer(monkeypatch)
    got, preempted, e = greedy(model_dir, "flashinfer")
    assert e.conditions()["attention_backend"] == "flashinfer-paged" and e.runner.kv.layout == "NHD"
    assert e.runner.attention.wrapper.plans > 0
    assert got == ref and len(got) == 5
    assert preempted > 0  # the plan was also right for recomputed, chunked and mixed steps
