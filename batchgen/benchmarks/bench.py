"""The judge: engines side by side on the same held prompts, in one run, with the run's conditions.

    batchgen bench --engines native,vllm,hf --batches 1,8,64,256 --modes greedy,sampled

For each batch size B (B requests in flight: B prompts at a time, at least MIN_PROMPTS in all) and each
mode (greedy; sampled at T 0.7, top-p 0.95), every engine generates `--new-tokens` tokens per prompt
(ignore_eos) from the same chat-templated prompts of 100 to 500 tokens, written as a dataset-generation
job writes them: worked examples, then a task to answer (few_shot_prompt_ids; Stanford Alpaca's 175 seed
tasks with their answers, CC BY-NC, shipped in batchgen/benchmarks/data). It prints tok/s, ITL
p50/p95/p99 (per-token gaps after the first, pooled), MBU (bytes read per second over the peak the
hardware probe measured; over the whole run, and over the decode-only steps, which are the
memory-bound part) and the ratio to the best peer in the same row group. The native engine
runs in fp32 eager (`native`); with the decode step compiled per bucket (`native:compiled`); the
same with oneDNN's matmul in place of batchgen's gemv kernel (`native:onednn`, where gemv is in use); as
`native:auto`, in the dtype `--dtype auto` picks; and as `native:int4`, with 4-bit weights and bf16
activations; the last three compiled, warmed up untimed per batch (the compile seconds printed),
with their greedy agreement with eager fp32 (share of tokens before each row's first divergence).
The native variants are measured interleaved within each cell, so the machine's drift falls on all
of them; MBU is against the peak read bandwidth measured again beside each repeat. The
"pick %" column is the native engine's time choosing tokens (argmax, or the sampler) as a share of
its decode steps. "pre MFU" is the native engine's prefill: its prompt tokens' matmul FLOPs (2 per
weight of the layers' matrices) per second over the peak matmul FLOP/s in its dtype, measured at the
start of the run. The targets are judged at the median decode step (median over the repeats), with
the whole-run figures beside them (see `targets`). A speculative-decoding section runs n-gram
speculation on and off on a workload that copies from its prompt and on an open-ended one, on the
native engine and vLLM, with acceptance rates; a slow-down prints as a ratio below 1.

Start-up (model load, vLLM's engine core) is excluded; prefill is included. Everything lands in one
Parquet file (`--out`), one row per measurement, with the conditions. Machines are shared and noisy:
compare ratios from one run, never absolute numbers across runs. This module runs the engines and
measures; the table, the ratios and the targets' verdict are batchgen.benchmarks.bench_results'.
"""

from __future__ import annotations

import gc
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from batchgen.benchmarks.bench_results import Measurement, compare
from batchgen.config import DTYPE_BYTES, ENGINES, EngineConfig, SamplingParams, kv_bytes_per_token

MIN_PROMPTS = 4  # batch 1 runs four prompts one after another
WARM_UP_PASSES = 3  # the most untimed passes a `--compile auto` variant runs to reach its steady state
# the same seed tasks with their answers (CC BY-NC, the licence beside it), for the grid's few-shot prompts
HELD_TASKS = Path(__file__).parent / "data" / "held_tasks.jsonl"
PROMPT_TOKENS = (100, 500)  # the grid's chat prompts span this many tokens, as real dataset-generation prompts do
MODES = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.7, top_p=0.95)}
# the native engine's variants (`--native-variants`): default, what `batchgen generate` runs with its
# default flags (the row the targets judge); fp32 eager; compiled; compiled on oneDNN's fp32
# kernel; --dtype auto (batch-invariant, the default); --dtype auto --batch-invariant off (`loose`: the
# fastest kernels for the batch, whose rows depend on it); int4 weights; the GGUF's own blocks
NATIVE_VARIANTS = ("default", "eager", "compiled", "onednn", "auto", "loose", "int4", "gguf")
# the protocol, fixed before a run and recorded with it (conditions["protocol"]); never changed after one
PROTOCOL = ("each cell: --repeats runs, the engines taking turns in an order that rotates each repeat, after an "
            "untimed warm-up each (a --compile auto engine's until it has compiled what it will); the repeat of median tok/s is the cell, every repeat's tok/s is kept "
            "(repeat_tok_per_s) and none is dropped; prefill included, EOS ignored; every engine computes on this "
            "process's cores (vLLM's model bound to them by VLLM_CPU_OMP_THREADS_BIND, llama.cpp with as many "
            "threads as torch); MBU against the read peak measured beside each repeat; prefill MFU = the cell's "
            "median prefill tok/s x a prompt token's matmul FLOPs / the median of the matmul peaks measured beside "
            "its repeats, in its dtype")
COPY_TEMPLATE = "Repeat the following text exactly, word for word, and nothing else:\n\n{text}"


def held_prompts(n: int) -> list[str]:
    """The first n held prompts (the held tasks without their answers); past the 175, again with a
    variant number (so no two share a prefix that a prefix cache could serve)."""
    base = [task for task, _ in held_tasks()]
    return [base[i] if i < len(base) else f"(variant {i // len(base)}) {base[i % len(base)]}" for i in range(n)]


def chat_ids(tok, texts: list[str]) -> list[list[int]]:
    """Each text as a one-turn chat, rendered with the model's template and tokenized."""
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]


def held_prompt_ids(tok, n: int, length: int | None = None) -> list[list[int]]:
    """The bench's n chat prompts: few-shot prompts of PROMPT_TOKENS tokens (few_shot_prompt_ids); or,
    with `length`, n chat prompts of `length` tokens (sized_prompt_ids)."""
    if length is not None:
        return sized_prompt_ids(tok, n, length)
    return few_shot_prompt_ids(tok, n)


def held_tasks() -> list[tuple[str, str]]:
    """(task, answer) for each held seed task: its instruction (and input), and its first answer."""
    import json

    out = []
    for line in HELD_TASKS.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            first = row["instances"][0]
            out.append((row["instruction"] + (f"\n\n{first['input']}" if first["input"] else ""), first["output"]))
    return out


def few_shot_prompt_ids(tok, n: int, lo: int = PROMPT_TOKENS[0], hi: int = PROMPT_TOKENS[1]) -> list[list[int]]:
    """n chat prompts of lo to hi tokens, as a dataset-generation job writes them (self-instruct style):
    worked examples (held tasks with their answers), then a task to answer. The examples are the held
    tasks that take at most (hi - lo) / 2 tokens; prompt i starts at example i and adds the next ones
    while it stays within hi, until it reaches its own target length (the targets spread evenly over
    lo..hi); it asks the i-th task that fits. No two prompts start with the same example, so no prefix
    cache serves one from another (past the examples' count, a variant number leads the message)."""
    tasks = held_tasks()
    frame = len(chat_ids(tok, ["x"])[0])
    cost = [len(tok.encode(f"Task: {t}\nAnswer: {a}\n\n")) for t, a in tasks]
    examples = [k for k in range(len(tasks)) if cost[k] <= (hi - lo) // 2]
    asks = [k for k in range(len(tasks)) if frame + 16 + len(tok.encode(f"Task: {tasks[k][0]}\nAnswer:")) <= lo]
    out = []
    for i in range(n):
        target, ask = lo + (i * 211) % (hi - lo + 1), asks[i % len(asks)]
        if ask == examples[i % len(examples)]:  # the first example is prompt i's own; ask another task
            ask = asks[(i + 1) % len(asks)]
        head = f"(variant {i // len(examples)})\n\n" if i >= len(examples) else ""
        tail = f"Task: {tasks[ask][0]}\nAnswer:"
        size, shown = frame + len(tok.encode(head + tail)), []
        for j in range(len(examples)):
            k = examples[(i + j) % len(examples)]
            if size >= target and shown:
                break
            if k != ask and size + cost[k] <= hi - 8:  # 8: the joins can encode a few tokens longer
                shown.append(k)
                size += cost[k]
        message = head + "".join(f"Task: {tasks[k][0]}\nAnswer: {tasks[k][1]}\n\n" for k in shown) + tail
        out.append(chat_ids(tok, [message])[0])
    return out


def sized_prompt_ids(tok, n: int, length: int) -> list[list[int]]:
    """n chat prompts of `length` tokens (one fewer where no cut encodes to it): prompt i's message is
    held instructions i, i+1, ... joined by blank lines (so no two prompts share a prefix a cache could
    serve), cut to the tokens that make the rendered chat `length` long. Real text of a set length: a
    prefill workload whose FLOPs do not depend on which prompts came first."""
    frame = len(chat_ids(tok, ["x"])[0])
    if length <= frame:
        raise ValueError(f"--prompt-tokens {length}: the chat template alone takes {frame} tokens; ask for more")
    texts = held_prompts(n + 8 + length // 16)
    out = []
    for i in range(n):
        words, k = tok.encode("\n\n".join(texts[i:i + 8 + length // 16])), length
        for _ in range(8):  # decoding and encoding again can merge or split a token at the cut
            ids = chat_ids(tok, [tok.decode(words[:k])])[0]
            if len(ids) == length:
                break
            k += length - len(ids)
        out.append(ids[:length] if len(ids) >= length else ids)
    return out


def _median(values) -> float | None:
    got = sorted(v for v in values if v is not None)
    return got[len(got) // 2] if got else None


def _percentiles(gaps: list[float]) -> dict[str, float | None]:
    if not gaps:
        return {"itl_p50_s": None, "itl_p95_s": None, "itl_p99_s": None}
    import numpy as np

    p = np.percentile(np.asarray(gaps), [50, 95, 99])
    return {"itl_p50_s": float(p[0]), "itl_p95_s": float(p[1]), "itl_p99_s": float(p[2])}


# ---- engines behind batchgen's Engine interface (native, vllm) --------------------------------------

def run_engine(engine, prompt_ids: list[list[int]], batch: int, params: SamplingParams, peak_bw: float | None,
               tag: str) -> dict:
    """Feed `batch` prompts at a time, step to the end; tokens, seconds, ITL gaps, MBU, drafts."""
    tokens = bytes_read = drafts = accepted = dec_bytes = dec_tokens = pre_tokens = cached = preempted = 0
    dec_s = pre_s = 0.0
    dec_steps: list[float] = []
    picks = hasattr(engine, "sample_seconds")  # the native engine's time choosing tokens; peers report none
    pick_s = 0.0
    gaps: list[float] = []
    outputs: dict[int, list[int]] = {}
    seconds = 0.0
    for s in range(0, len(prompt_ids), batch):
        last: dict[str, float] = {}
        t0 = time.perf_counter()
        for i in range(s, min(s + batch, len(prompt_ids))):
            engine.add(f"{tag}-{i}", prompt_ids[i], params)
        while engine.has_unfinished():
            before = engine.sample_seconds if picks else 0.0
            r = engine.step()
            tokens += len(r.token_request_ids)
            bytes_read += r.bytes_read or 0
            if not r.num_prefill_tokens and r.token_request_ids:
                dec_bytes += r.bytes_read or 0
                dec_s += r.end_t - r.start_t
                dec_tokens += len(r.token_request_ids)
                dec_steps.append(r.end_t - r.start_t)
                pick_s += engine.sample_seconds - before if picks else 0.0
            elif r.num_prefill_tokens:
                pre_tokens += r.num_prefill_tokens
                pre_s += r.end_t - r.start_t
            drafts += r.num_draft_tokens
            accepted += r.num_accepted_tokens
            preempted += r.num_preempted or 0
            for rid in r.token_request_ids:
                if rid in last:
                    gaps.append(r.end_t - last[rid])
                last[rid] = r.end_t
            for f in r.finished:
                outputs[int(f.request_id.rsplit("-", 1)[1])] = list(f.output_token_ids)
                cached += f.num_cached_tokens or 0
        seconds += time.perf_counter() - t0
    return {"tokens": tokens, "seconds": seconds, **_percentiles(gaps),
            "mbu": bytes_read / seconds / peak_bw if peak_bw and seconds else None,
            "decode_mbu": dec_bytes / dec_s / peak_bw if peak_bw and dec_s else None,
            # the mean step's bytes over the median step's time: a slow patch of a shared machine moves
            # the sum of step times (decode_mbu) but not the median
            "decode_mbu_p50": (dec_bytes / len(dec_steps) / sorted(dec_steps)[len(dec_steps) // 2] / peak_bw
                               if peak_bw and dec_steps else None),
            "acceptance_rate": accepted / drafts if drafts else None,
            "sample_share": pick_s / dec_s if picks and dec_s else None,
            "decode_tok_per_s": dec_tokens / dec_s if dec_s else None,
            "prefill_tok_per_s": pre_tokens / pre_s if pre_s else None,
            "cached_prompt_tokens": cached, "preemptions": preempted, "outputs": [outputs[i] for i in sorted(outputs)]}


def prompt_token_flops(model_dir) -> int:
    """A prompt token's matmul FLOPs: 2 per weight of every layer's four matrices (attention's scores,
    the norms and the LM head, which a prompt runs only at its last token, are left out), the figure
    prefill MFU counts."""
    from batchgen.engine.precision import decode_matrices
    from batchgen.model.loader import read_model_config

    c = read_model_config(model_dir)
    return 2 * c.num_layers * sum(n * k for n, k in decode_matrices(c)[:4])


def make_engine(name: str, model_dir, dtype: str, max_num_seqs: int, max_model_len: int, kv_tokens: int,
                k: int = 0, quantization: str = "none", compile_: str = "off", fp32_kernel: str = "auto",
                batch_invariant: str = "auto", prefix_caching: bool = False):
    from batchgen.engine import create_engine

    cfg = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len, dtype=dtype, quantization=quantization,
                       compile=compile_ if name == "native" else "auto",
                       kv_cache_tokens=kv_tokens,  # room for every row in flight: no preemption
                       max_num_batched_tokens=max(4096, max_model_len), speculative_ngram=k,
                       # the study variants turn it off (a pure decode test); `default` keeps generate's
                       enable_prefix_caching=prefix_caching,
                       fp32_kernel=fp32_kernel, batch_invariant=batch_invariant)
    return create_engine(name, model_dir, cfg)


@dataclass(frozen=True)
class Variant:
    """One of the native engine's measured configurations (`--native-variants`)."""

    name: str  # native, native:compiled, native:default, ...
    dtype: str
    quantization: str = "none"
    compile: str = "off"
    fp32_kernel: str = "auto"
    batch_invariant: str = "auto"
    prefix_caching: bool = False


def default_variant(name: str = "native") -> Variant:
    """What `batchgen generate` runs with its default flags (EngineConfig's defaults); the bench sets only
    the batch width, the context length and a KV pool that holds every row (said beside its row)."""
    d = EngineConfig()
    return Variant(f"{name}:default", d.dtype, d.quantization, d.compile, d.fp32_kernel, d.batch_invariant,
                   d.enable_prefix_caching)


def tree_cpu_s() -> float:
    """CPU seconds (user + system) of this process and every process under it (vLLM's engine core runs
    in a child): what an engine's run cost in compute, whichever process did the work."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:  # exited between the listing and the read
            continue
    return total


# ---- Hugging Face transformers: the reference peer ------------------------------------------------------

class HFRunner:
    def __init__(self, model_dir, dtype: str):
        import torch
        from transformers import AutoModelForCausalLM

        from batchgen.model.loader import count_decode_weight_elements, read_hf_shape

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        bpe = torch.finfo(getattr(torch, dtype)).bits // 8
        shape = read_hf_shape(model_dir)
        self.weight_bytes = count_decode_weight_elements(model_dir) * bpe
        self.kv_bytes_per_token = 2 * shape["num_layers"] * shape["num_kv_heads"] * shape["head_dim"] * bpe
        self.pad_id = 0

    def run(self, prompt_ids: list[list[int]], batch: int, mode: str, new_tokens: int, peak_bw: float | None) -> dict:
        """Left-padded batches through `generate`; a logits processor stamps each step's time (ITL)."""
        torch = self.torch
        tokens, seconds, gaps, nbytes, outputs = 0, 0.0, [], 0, []
        for s in range(0, len(prompt_ids), batch):
            rows = prompt_ids[s:s + batch]
            width = max(len(r) for r in rows)
            ids = torch.tensor([[self.pad_id] * (width - len(r)) + r for r in rows])
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
            stamps: list[float] = []

            def stamp(input_ids, scores):
                stamps.append(time.perf_counter())
                return scores

            sampling = MODES[mode]
            kw = (dict(do_sample=True, temperature=sampling["temperature"], top_p=sampling["top_p"])
                  if sampling["temperature"] else dict(do_sample=False))
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                          min_new_tokens=new_tokens, pad_token_id=self.pad_id,
                                          logits_processor=[stamp], **kw)
            seconds += time.perf_counter() - t0
            n = out.shape[1] - width
            tokens += n * len(rows)
            gaps += [b - a for a, b in zip(stamps, stamps[1:])] * len(rows)  # every row gets each step's gap
            nbytes += n * self.weight_bytes + len(rows) * sum(width + j for j in range(n)) * self.kv_bytes_per_token
            outputs += out[:, width:].tolist()
        return {"tokens": tokens, "seconds": seconds, **_percentiles(gaps),
                "mbu": nbytes / seconds / peak_bw if peak_bw and seconds else None,
                "preemptions": 0, "outputs": outputs}  # a padded static batch: nothing to preempt


# ---- the run ---------------------------------------------------------------------------------------------

def run_bench(model_dir, engines: list[str], batches: list[int], modes: list[str], new_tokens: int = 64,
              speculative_k: int = 4, spec_batch: int = 8, log=print,
              repeats: int = 1, native_variants: tuple[str, ...] = NATIVE_VARIANTS,
              prompt_tokens: int | None = None) -> tuple[list[Measurement], dict]:
    """`prompt_tokens`: every prompt that long (sized_prompt_ids), instead of the few-shot prompts of
    100 to 500 tokens (few_shot_prompt_ids)."""
    from batchgen.metrics.probe import cached_probe, peak_matmul, peak_read, probe_device
    from batchgen.model.tokenizer import Tokenizer

    unknown = [e for e in engines if ":" in e and not is_peer(e)]
    if unknown:
        raise ValueError(f"unknown engine {unknown[0]!r}: the peers take vllm-generate:fp32 or vllm-generate:bf16")
    device = "cpu"
    probe = cached_probe(device)
    # the roofline measured now, in this run: a shared machine's bandwidth drifts (the cached probe said
    # 49 GB/s one afternoon, 35 that evening), and MBU against a figure from another hour says little
    fresh = probe_device(device)
    peak_bw = fresh["peak_read_bytes_per_s"]
    peak_flops = {"float32": fresh["peak_flops_fp32"], "bfloat16": fresh["peak_flops_bfloat16"]}
    flops_per_token = prompt_token_flops(model_dir)
    tok = Tokenizer(model_dir)

    def chat(texts: list[str]) -> list[list[int]]:
        return chat_ids(tok, texts)

    most = max(max(batches), MIN_PROMPTS)
    held = held_prompt_ids(tok, most, prompt_tokens)
    max_len = max(len(p) for p in held) + new_tokens + 8
    results: list[Measurement] = []

    def grid_prompts(b: int) -> list[list[int]]:
        return held[:max(b, MIN_PROMPTS)]

    # KV for the b longest of a batch's prompts in flight at once (each padded to whole 16-position blocks;
    # batch 1 runs MIN_PROMPTS one after another, and the longest must fit)
    kv_tokens = max(sum(sorted((len(p) + new_tokens + 32 for p in grid_prompts(b)), reverse=True)[:b])
                    for b in batches)

    def record(m: Measurement, extra: dict) -> Measurement:
        for k, v in extra.items():
            setattr(m, k, v)
        results.append(m)
        if m.cached_prompt_tokens:  # a run's prompts are new to every engine: a hit means one was served, not
            # computed (with the cache emptied before each call, only what the call's own rows share: a template's head)
            log(f"  WARNING: {m.engine} batch {m.batch}: {m.cached_prompt_tokens} prompt tokens came from its "
                "prefix cache")
        if m.preemptions:  # a peer or engine that had to preempt inside a timed call: flagged
            log(f"  WARNING: {m.engine} batch {m.batch}: {m.preemptions} preemptions in its timed calls")
        log(f"  {m.engine:<15} {m.dtype:<9} batch {m.batch:>3} {m.mode:<8} {m.workload:<5} k={m.speculative_k} "
            f"{m.tok_per_s:8.1f} tok/s")
        return m

    # the grid: engines x batch x mode
    from batchgen.model import ggml
    from batchgen.model.linear import can_int4, fp32_kernel

    gguf = sorted(Path(model_dir).glob("*.gguf"))
    has_gguf = bool(gguf) and not isinstance(ggml.load(), str)

    variants: list[Variant] = []
    # fp32 on batchgen's gemv where it builds, with oneDNN's as its peer: not `auto`, which takes one
    # of them for the band of max(batches) and so would put every batch on the same one
    has_gemv = fp32_kernel("auto", "cpu")[0] is not None
    fp32 = "gemv" if has_gemv else "auto"
    for name in [e for e in engines if not is_peer(e)]:
        if name == "native":
            variants.append(default_variant())
        variants.append(Variant(name, "float32", fp32_kernel=fp32 if name == "native" else "auto"))
        if name == "native":  # eager above; below, the decode step compiled per bucket (warmed up first)
            variants.append(Variant("native:compiled", "float32", compile="on", fp32_kernel=fp32))
            if has_gemv:
                variants.append(Variant("native:onednn", "float32", compile="on", fp32_kernel="onednn"))
            variants.append(Variant("native:auto", "auto", compile="on"))
            variants.append(Variant("native:loose", "auto", compile="on", batch_invariant="off"))
            if can_int4("cpu"):  # the 4-bit weight path, measured where it loses too
                variants.append(Variant("native:int4", "bfloat16", "int4", compile="on"))
            if has_gguf:  # the GGUF's own Q4_1 / Q8_0 blocks (batchgen's qgemv kernel), float32 activations
                variants.append(Variant("native:gguf", "float32", "gguf", compile="on"))
    variants = [v for v in variants if v.name.split(":")[0] != "native" or
                (v.name.split(":") + ["eager"])[1] in native_variants]

    beside: list[float] = []  # the read peak measured beside each repeat of each cell, in order
    beside_flops: dict[str, list[float]] = {}  # the matmul peak beside each repeat, per dtype a cell prefilled in

    def measure_cells(group: list[tuple[str, str, Callable, Callable | None, dict]]) -> None:
        """Each batch's cells measured `repeats` times, the median kept. The variants of one engine
        (the native engine's: eager, compiled, best dtype, int4) are measured interleaved, one after
        another in each cell, their order rotating with each repeat; a variant's two modes run back to
        back, greedy first or sampled first by turns: a shared machine drifts by tens of percent over
        minutes, and a slow patch then falls on every variant and on both modes, not on one.
        `warm_up(b)` first runs the batch once untimed (a compiled engine compiles its buckets there)
        and returns the seconds compiled. The read peak is measured again before each repeat, and the
        repeat's MBU is against it (`measure(b, mode, peak)`): the probe at the run's start can fall in
        a quiet moment of a shared machine and the cells minutes later in a busy one. So is the matmul
        peak in each native cell's dtype, and the cell's prefill MFU is its median prefill rate against
        the median of those (one denominator, fixed before the run: PROTOCOL). Each measure is timed in
        CPU seconds too (tree_cpu_s), and each cell says where its engine computed (`where`: cores,
        threads)."""
        prefilled = {dtype for name, dtype, *_ in group if name.startswith("native") and dtype in peak_flops}
        for b in batches:
            compile_s = {name: warm_up(b) if warm_up else None for name, _, _, warm_up, _ in group}
            runs: dict[tuple[str, str], list[dict]] = {(name, mode): [] for name, *_ in group for mode in modes}
            for rep in range(repeats):
                peak = peak_read(device) if peak_bw else None
                beside.append(peak)
                flops = {d: peak_matmul(device, d)[0] for d in sorted(prefilled)}
                for d, f in flops.items():
                    beside_flops.setdefault(d, []).append(f)
                order = group[rep % len(group):] + group[:rep % len(group)]
                for i, (name, dtype, measure, _, _) in enumerate(order):  # a variant's modes back to back
                    for mode in (modes if (rep + i) % 2 == 0 else modes[::-1]):
                        cpu0 = tree_cpu_s()
                        got = measure(b, mode, peak)
                        if got is not None:  # None: this engine does not run this mode
                            runs[(name, mode)].append({**got, "cpu_s": tree_cpu_s() - cpu0,
                                                       "peak_read_bytes_per_s": peak, "peak_flops":
                                                       flops.get(dtype) if name.startswith("native") else None})
            for name, dtype, _, _, where in group:
                for mode in modes:
                    if not runs[(name, mode)]:
                        continue
                    in_time = runs[(name, mode)]  # every repeat, in the order measured: all kept in the record
                    ms = sorted(in_time, key=lambda m: m["tokens"] / m["seconds"])
                    rates = [m["tokens"] / m["seconds"] for m in ms]
                    med = ms[len(ms) // 2]
                    preempted = [m.get("preemptions") for m in ms]
                    prefill = _median(m.get("prefill_tok_per_s") for m in ms)
                    peak_f = _median(m["peak_flops"] for m in ms)
                    # repeats: those measured (a peer that died mid-cell has fewer)
                    record(Measurement("grid", name, dtype, b, mode, "held", 0, len(grid_prompts(b)), 0, 0.0),
                           {**med, "repeats": len(ms), "compile_s": compile_s[name],
                            "repeat_tok_per_s": [m["tokens"] / m["seconds"] for m in in_time],
                            "cpu_s": _median(m["cpu_s"] for m in ms), **where,
                            "preemptions": None if None in preempted else sum(preempted),
                            "step_itl_p50_s": _median(m.get("itl_p50_s") for m in ms),
                            "decode_mbu_p50": _median(m.get("decode_mbu_p50") for m in ms),
                            "peak_read_bytes_per_s": _median(m["peak_read_bytes_per_s"] for m in ms),
                            "prefill_tok_per_s": prefill,
                            "prefill_mfu": (prefill * flops_per_token / peak_f if prefill and peak_f else None),
                            "peak_flops": peak_f,
                            "spread": (rates[-1] - rates[0]) / rates[len(ms) // 2] if len(ms) > 1 else None})

    def engine_cell(engine, compiled: bool, settles: bool = False) -> tuple[Callable, Callable | None]:
        def measure(b: int, mode: str, peak: float | None) -> dict:
            if hasattr(engine, "reset_prefix_cache"):  # every repeat computes its prompts, as vLLM's does (_forget)
                engine.reset_prefix_cache()
            return run_engine(engine, grid_prompts(b), b,
                              SamplingParams(max_tokens=new_tokens, ignore_eos=True, **MODES[mode]), peak,
                              f"{mode}{b}")

        def warm_up(b: int) -> float:
            """Untimed passes until the engine is in its steady state: one pass; with `--compile auto`
            (generate's default), passes until a compile has come and a pass then compiles nothing more
            (at most WARM_UP_PASSES): a long job compiles once its eager steps cost a compile, and a
            compile inside a timed repeat measures that job's first minutes, not its hours."""
            start = compiled_s = engine.conditions().get("compile_s") or 0.0
            for k in range(WARM_UP_PASSES if settles else 1):
                run_engine(engine, grid_prompts(b), b, SamplingParams(max_tokens=new_tokens, ignore_eos=True),
                           peak_bw, f"warm{b}-{k}")
                now = engine.conditions().get("compile_s") or 0.0
                if now == compiled_s and (now > start or k >= 1):  # compiled and settled; or two passes of
                    break  # eager steps did not reach a compile's cost: this workload stays eager
                compiled_s = now
            return compiled_s - start

        return measure, (warm_up if compiled else None)

    from batchgen.benchmarks import peers as outside

    failed: dict[str, str] = {}  # outside peers that died in this run: where, and what they raised
    peers = _peer_cells([e for e in engines if is_peer(e)], gguf, model_dir, batches, max_len, kv_tokens, new_tokens,
                        grid_prompts, log, failed)
    for engine_name in [e for e in engines if not is_peer(e)]:
        group_variants = [v for v in variants if v.name.split(":")[0] == engine_name]
        log(f"{', '.join(f'{v.name} ({v.dtype})' for v in group_variants)} ...")
        if engine_name == "hf":
            runner = HFRunner(model_dir, "float32")
            measure_cells([("hf", "float32", lambda b, mode, peak: runner.run(grid_prompts(b), b, mode, new_tokens,
                                                                              peak), None,
                            {"cores": outside.this_process_cores(), "threads": _threads()})])
            del runner
            gc.collect()
            continue
        built = [(v.name, make_engine(engine_name, model_dir, v.dtype, max(batches), max_len, kv_tokens,
                                      quantization=v.quantization, compile_=v.compile, fp32_kernel=v.fp32_kernel,
                                      batch_invariant=v.batch_invariant, prefix_caching=v.prefix_caching),
                  v.compile != "off")
                 for v in group_variants]
        # the outside peers take turns with the native variants inside each cell (see measure_cells)
        here = {"cores": outside.this_process_cores(), "threads": _threads()}
        cells = [(name, e.conditions().get("dtype", "float32"), *engine_cell(e, compiled, v.compile == "auto"), here)
                 for (name, e, compiled), v in zip(built, group_variants)]
        measure_cells(cells + ([c for c, _ in peers] if engine_name == "native" else []))
        for _, e, _ in built:
            e.close()
        del built
        gc.collect()

    if peers and "native" not in engines:
        measure_cells([c for c, _ in peers])
    for _, close in peers:
        close()

    # speculation: a workload that copies from its prompt, and an open-ended one
    if speculative_k:
        texts = held_prompts(spec_batch)
        workloads = {"copy": chat([COPY_TEMPLATE.format(text=t) for t in texts]), "open": chat(texts)}
        spec_len = max(len(p) for w in workloads.values() for p in w) + new_tokens + 8
        spec_kv = max(sum(len(p) + new_tokens + 32 for p in w) for w in workloads.values())
        for name in [e for e in engines if e in ENGINES]:  # batchgen's own engines; the peers run no drafts here
            for k in (0, speculative_k):
                log(f"{name} speculative k={k} ...")
                engine = make_engine(name, model_dir, "float32", spec_batch, spec_len, spec_kv, k, compile_="off")
                for w, prompts in workloads.items():
                    params = SamplingParams(max_tokens=new_tokens, ignore_eos=False)  # copying ends by itself
                    m = run_engine(engine, prompts, spec_batch, params, peak_bw, f"{w}{k}")
                    record(Measurement("speculative", name, "float32", spec_batch, "greedy", w, k, len(prompts), 0,
                                       0.0), m)
                engine.close()
                del engine
                gc.collect()
    compare(results)
    conditions = {**run_conditions(model_dir, new_tokens, repeats),
                  "peak_read_bytes_per_s": peak_bw, "probe": "measured at the start of this run",
                  "peak_read_beside_repeats": [b for b in beside if b],  # each cell's MBU is against its repeat's
                  "peak_flops_beside_repeats": beside_flops,  # and its prefill MFU against these
                  "peak_flops": peak_flops, "prompt_token_flops": flops_per_token,
                  "cached_probe_read_bytes_per_s": probe.get("peak_read_bytes_per_s"),
                  "cached_probe": f"{probe.get('probe_source')}, measured {probe.get('probe_measured_at')}",
                  "peers_failed": failed,
                  "prompts": prompts_text(held, prompt_tokens),
                  "prompt_length": prompt_tokens}  # set by --prompt-tokens (the prefill target's), else None
    if "llama.cpp" in engines and "llama.cpp" not in failed:
        from batchgen.benchmarks import peers as outside

        if outside.llama_cpp_available() is None:  # the instructions its build uses, beside batchgen's
            conditions["llama_cpp_build"] = outside.llama_cpp_build()
    if "native" in engines:  # what `--fp32-kernel auto` takes per batch on this machine and model
        from batchgen.engine.precision import decode_matrices, resolve_fp32_kernel
        from batchgen.model.loader import read_model_config

        shapes = decode_matrices(read_model_config(model_dir))
        conditions["fp32_kernel_auto"] = {str(b): resolve_fp32_kernel("auto", device, b, shapes)[0] for b in batches}
    return results, conditions


PEERS = ("llama.cpp", "vllm-generate")  # outside peers, run as their own users run them (batchgen.benchmarks.peers)
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # vllm-generate:fp32 / :bf16 runs one dtype (both by default)


def is_peer(name: str) -> bool:
    """An outside peer's name: llama.cpp, vllm-generate, or vllm-generate:fp32 / :bf16 (one dtype: on a
    CPU without bf16 math vLLM's bf16 crawls, and a batch-256 run of it takes most of an hour), each
    computing on this process's cores; `:default` after the dtype keeps vLLM's own binding instead (one
    core reserved for its scheduler: shown, never judged)."""
    base, *rest = name.split(":")
    if base == "llama.cpp":
        return not rest
    return (base == "vllm-generate" and len(rest) <= 2 and (not rest or rest[0] in VLLM_DTYPES)
            and (len(rest) < 2 or rest[1] == "default"))


def _outlived(name: str, what: str, call: Callable, failed: dict[str, str], log) -> Callable:
    """`call` (an outside peer's measure, warm-up or close), such that the peer's failure ends the
    peer, not the bench: what it raised goes into `failed[name]` and a line, and from then on the peer
    is not called again (its later cells stay empty, as for a mode it does not run). A peer is run as
    its own users run it, bugs included (vLLM 0.32 on CPU dies on seeded sampled rows whose prompts
    it prefills in chunks); batchgen's own engines get no such cover: their failure ends the run."""
    def outlived(*args):
        if name in failed and what != "closing":  # a dead peer is still closed, to free what it holds
            return None
        try:
            return call(*args)
        except Exception as e:  # noqa: BLE001 - whatever the peer raised is reported, with its type
            where = what + (f" batch {args[0]}" if args else "") + (f" {args[1]}" if len(args) > 1 else "")
            why = f"{where}: {type(e).__name__}: {e}"[:400]
            failed.setdefault(name, why)  # the first failure is the one that ended it
            log(f"{name} failed, left out of the rest of this run ({why})")
            return None

    return outlived


def _peer_cells(names: list[str], gguf: list[Path], model_dir, batches: list[int], max_len: int, kv_tokens: int,
                new_tokens: int, grid_prompts: Callable, log, failed: dict[str, str]) -> list[tuple[tuple, Callable]]:
    """((name, dtype, measure, warm_up), close) for each outside peer that can run here; a line for
    each that cannot. llama.cpp decodes greedily only (its sampled cells stay empty). A peer that
    raises is left out from then on, and said so in `failed` (see _outlived)."""
    cells = []
    for peer in names:
        try:
            started = _start_peer(peer, gguf, model_dir, batches, max_len, kv_tokens, new_tokens, grid_prompts, log)
        except Exception as e:  # noqa: BLE001 - a peer that cannot start is reported like one that dies
            failed[peer] = f"starting: {type(e).__name__}: {e}"[:400]
            log(f"{peer} failed, left out of this run ({failed[peer]})")
            continue
        cells += [((name, dtype, _outlived(name, "measuring", measure, failed, log),
                    warm_up and _outlived(name, "warming up", warm_up, failed, log), where),
                   _outlived(name, "closing", close, failed, log))
                  for (name, dtype, measure, warm_up, where), close in started]
    return cells


def _start_peer(name: str, gguf: list[Path], model_dir, batches: list[int], max_len: int, kv_tokens: int,
                new_tokens: int, grid_prompts: Callable, log) -> list[tuple[tuple, Callable]]:
    """Outside peer `name`'s cells, started: none, with a line, where it cannot run here."""
    from batchgen.benchmarks import peers
    from batchgen.model.loader import read_hf_shape

    cells = []
    if name == "llama.cpp":
        why = peers.llama_cpp_available() or (None if gguf else f"no GGUF in {model_dir}")
        if why:
            log(f"llama.cpp left out: {why}")
            return cells
        runner = peers.LlamaCppRunner(gguf[0], max(batches), max_len, _threads())  # as many threads as native
        if runner.note:
            log(f"llama.cpp: {runner.note}")

        def measure(b: int, mode: str, peak_bw: float | None, runner=runner) -> dict | None:
            if mode != "greedy":
                return None  # llama.cpp's sampler chain is not run here
            m = runner.run(grid_prompts(b), b, new_tokens)
            steps = sorted(m["decode_steps"])
            nbytes = runner.weight_bytes
            return {"tokens": m["tokens"], "seconds": m["seconds"], **_percentiles(m["gaps"]),
                    "decode_tok_per_s": m["decode_tokens"] / m["decode_s"] if m["decode_s"] else None,
                    "prefill_tok_per_s": m["prefill_tokens"] / m["prefill_s"] if m["prefill_s"] else None,
                    "decode_mbu": nbytes * len(steps) / m["decode_s"] / peak_bw if peak_bw and m["decode_s"] else None,
                    "decode_mbu_p50": nbytes / steps[len(steps) // 2] / peak_bw if peak_bw and steps else None,
                    # one KV stream per sequence, each sized for its longest row: it cannot preempt
                    "preemptions": 0, "outputs": m["outputs"]}

        cells.append(((name, "Q4_1", measure, lambda b, runner=runner: runner.run(grid_prompts(b), b, 4) and None,
                       {"cores": peers.this_process_cores(), "threads": _threads()}), runner.close))
    elif name.startswith("vllm-generate"):
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            log(f"vllm-generate left out: vLLM is not installed ({e})")
            return cells
        shape = read_hf_shape(model_dir)
        _, *rest = name.split(":")
        wanted = [VLLM_DTYPES[rest[0]]] if rest else list(VLLM_DTYPES.values())
        own_binding = rest[1:] == ["default"]
        cores = None if own_binding else peers.this_process_cores()  # equal compute: native's cores
        if len(wanted) > 1:
            log("vllm-generate: its fp32 and bf16 engines stay alive through the run, and vLLM pins each one's "
                "worker to the same cores (`core ids` in its log), so each slows the other. For a figure to judge "
                "by, name one dtype a run: vllm-generate:bf16 or vllm-generate:fp32")
        for dtype in wanted:  # room for every row in flight, in vLLM's own blocks and dtype
            per_token = kv_bytes_per_token(shape["num_layers"], shape["num_kv_heads"], shape["head_dim"],
                                           DTYPE_BYTES[dtype])
            kv_bytes = max(peers.vllm_kv_bytes(sorted((len(p) for p in grid_prompts(b)), reverse=True)[:b],
                                                   new_tokens, per_token)
                           for b in batches)
            runner = peers.VllmOwnRunner(model_dir, dtype, max(batches), max_len, kv_bytes, cores=cores)

            def measure(b: int, mode: str, peak_bw: float | None, runner=runner) -> dict:
                return runner.run(grid_prompts(b), b, new_tokens, **MODES[mode])  # no per-step times: no MBU

            tag = f"vllm-generate:{'fp32' if dtype == 'float32' else 'bf16'}" + (":default" if own_binding else "")
            where = ({"cores": "vLLM's default (one core reserved for its scheduler)", "threads": None}
                     if own_binding else {"cores": cores, "threads": len(peers.cpu_ids(cores))})
            cells.append(((tag, dtype, measure, None, where), runner.close))
    return cells


def prompts_text(prompts: list[list[int]], prompt_tokens: int | None = None) -> str:
    """The run's prompts, as its conditions record them."""
    return (f"chat prompts of {prompt_tokens} tokens (held instructions joined and cut)" if prompt_tokens else
            f"few-shot chat prompts of the held tasks, {min(map(len, prompts))} to {max(map(len, prompts))} tokens")


def run_conditions(model_dir, new_tokens: int, repeats: int) -> dict:
    """What every bench run records of its conditions: when, the model, the CPU (its name, family,
    model and vector flags, read at run time), cores (and those it may use), torch threads, the
    protocol and the packages' versions."""
    from batchgen.benchmarks.peers import this_process_cores
    from batchgen.metrics.conditions import cpu_features, cpu_model, package_versions

    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": str(model_dir), "cpu": cpu_model(),
            "cpu_features": cpu_features(), "machine": platform.machine(), "cores": os.cpu_count(),
            # the CPUs this run's engines computed on (taskset / cgroups narrow it below `cores`)
            "cores_used": this_process_cores(),
            "new_tokens": new_tokens, "repeats": repeats, "torch_threads": _threads(), "protocol": PROTOCOL,
            "packages": package_versions()}


def _threads() -> int:
    import torch

    return torch.get_num_threads()
