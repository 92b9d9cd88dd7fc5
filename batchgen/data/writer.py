"""The one owner of the output Parquet schema (docs/METRICS.md): requests, errors, tokens, steps.

`ShardWriter` turns engine StepResults and row errors into Arrow tables for one shard. It knows
nothing of torch; times arrive as seconds relative to the run start.
"""

from __future__ import annotations

import json

import pyarrow as pa

from batchgen.data.prompts import RowError

F64 = pa.float64()
REQUESTS_SCHEMA = pa.schema([
    ("id", pa.string()), ("sample_index", pa.int32()), ("num_samples", pa.int32()), ("prompt_tokens", pa.int32()), ("output_tokens", pa.int32()),
    ("output_token_ids", pa.list_(pa.int32())), ("text", pa.string()), ("finish_reason", pa.string()),
    ("enqueue_t", F64), ("schedule_t", F64), ("first_token_t", F64), ("last_token_t", F64),
    ("queue_s", F64), ("ttft_s", F64), ("prefill_s", F64), ("tpot_s", F64), ("e2e_s", F64),
    ("prompt_truncated_from", pa.int32()), ("num_cached_tokens", pa.int32()), ("num_preemptions", pa.int32()),
    ("seed", pa.int64()),  # the sampling seed the request ran with (the row's, or derived from the run seed and id)
    # what decides the row's tokens, hashed (batchgen.data.reuse); null where the run was not batch-invariant
    ("request_key", pa.string()),
    ("reused_from_run", pa.string()),  # the earlier run the row was copied from (--reuse-from); null: generated here
    # a thinking model's thought, apart from `text` (the answer); null where there was none
    ("reasoning", pa.string()), ("reasoning_tokens", pa.int32()), ("reasoning_cut", pa.bool_()),
])
# a reused row's own figures: what it was copied with (its timings stay null: it did not run here)
REUSED_COLUMNS = ("prompt_tokens", "output_tokens", "output_token_ids", "text", "finish_reason", "reasoning",
                  "reasoning_tokens", "reasoning_cut")
# sample_index / num_samples are null when the error covers the whole input row (every sample of it)
ERRORS_SCHEMA = pa.schema([("id", pa.string()), ("error", pa.string()), ("stage", pa.string()),
                           ("sample_index", pa.int32()), ("num_samples", pa.int32())])
TOKENS_SCHEMA = pa.schema([
    ("request_id", pa.string()), ("sample_index", pa.int32()), ("token_index", pa.int32()), ("step_id", pa.int64()), ("t", F64),
    ("itl_s", F64), ("context_len", pa.int32()), ("concurrency", pa.int32()), ("token_id", pa.int32()),
    ("logprob", pa.float32()),  # the chosen token's log-probability under the model (raw logits), when asked
    ("top_logprobs", pa.list_(pa.struct([("token_id", pa.int32()), ("logprob", pa.float32())]))),
])
STEPS_SCHEMA = pa.schema([
    ("step_id", pa.int64()), ("start_t", F64), ("end_t", F64), ("num_running", pa.int32()),
    ("num_waiting", pa.int32()), ("num_prefill_tokens", pa.int32()), ("num_decode_tokens", pa.int32()),
    ("sum_context_len", pa.int64()), ("bytes_read", pa.int64()),
    ("num_preempted", pa.int32()), ("num_cached_tokens", pa.int32()), ("num_lookup_tokens", pa.int32()),
    ("kv_blocks_used", pa.int32()), ("kv_blocks_total", pa.int32()),
    ("num_draft_tokens", pa.int32()), ("num_accepted_tokens", pa.int32()),  # speculative decoding
])
SCHEMAS = {"requests": REQUESTS_SCHEMA, "errors": ERRORS_SCHEMA, "tokens": TOKENS_SCHEMA, "steps": STEPS_SCHEMA}
# requests/ and errors/ end with the row's prompt as given, so a reader sees it beside the answer or the
# error: the prompt column, or for chat messages the last user turn (their full list: --keep-columns messages)
PROMPT = pa.field("prompt", pa.string())


def prompt_as_given(row: dict) -> str | None:
    """The row's prompt for a reader: its `prompt`, or the content of its last user message."""
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return prompt
    messages = row.get("messages")
    if isinstance(messages, str):  # JSON text (a Parquet string column); invalid JSON is the row's error
        try:
            messages = json.loads(messages)
        except ValueError:
            return None
    if isinstance(messages, list):
        users = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        return users[-1] if users and isinstance(users[-1], str) else None
    return None


class ShardWriter:
    def __init__(self, kept_schema: pa.Schema | None = None):
        self.kept_schema = kept_schema or pa.schema([])  # input columns carried into requests/ and errors/
        self._kept: dict[str, dict] = {}
        self._prompts: dict[str, str | None] = {}
        self.requests: dict[str, list] = {f: [] for f in REQUESTS_SCHEMA.names}
        self.errors: dict[str, list] = {f: [] for f in ERRORS_SCHEMA.names}
        self.tokens: dict[str, list] = {f: [] for f in TOKENS_SCHEMA.names}
        self.steps: dict[str, list] = {f: [] for f in STEPS_SCHEMA.names}
        self._last_t: dict[str, float] = {}
        # per engine request, filled by expect(): prompt truncation, seed, and (n > 1) its row and sample
        self.truncated: dict[str, int] = {}
        self.seeds: dict[str, int] = {}
        # engine request id -> (input row id, sample index, samples of the row); ids not here are rows of n = 1
        self.samples: dict[str, tuple[str, int, int]] = {}
        self.keys: dict[str, str] = {}  # engine request id -> its request key
        self.num_output_tokens = 0
        self.num_reused = 0

    def expect(self, request_id: str, row_id: str, sample_index: int, num_samples: int, seed: int | None,
               truncated_from: int | None, key: str | None = None) -> None:
        """What the requests/ row of an engine request records beside the engine's own figures."""
        self.seeds[request_id] = seed
        if key is not None:
            self.keys[request_id] = key
        if num_samples > 1:
            self.samples[request_id] = (row_id, sample_index, num_samples)
        if truncated_from is not None:
            self.truncated[request_id] = truncated_from

    def keep(self, row: dict) -> None:
        """Remember the row's prompt and its kept input columns."""
        self._prompts[row["id"]] = prompt_as_given(row)
        if self.kept_schema.names:
            self._kept[row["id"]] = {c: row.get(c) for c in self.kept_schema.names}

    def add_reused(self, request_id: str, earlier: dict) -> None:
        """A request answered by an earlier run's row of the same key (batchgen.data.reuse): its output
        copied, its timings null, its source named. expect() was called for it as for any request."""
        q = self.requests
        for name in REQUESTS_SCHEMA.names:
            q[name].append(earlier.get(name) if name in REUSED_COLUMNS else None)  # older runs lack the newer columns
        q["id"][-1] = request_id
        q["prompt_truncated_from"][-1] = self.truncated.pop(request_id, None)
        q["seed"][-1] = self.seeds.pop(request_id, None)
        q["request_key"][-1] = self.keys.pop(request_id, None)
        q["reused_from_run"][-1] = earlier["source_run"]
        self.num_reused += 1

    def add_error(self, err: RowError) -> None:
        """An error row: for the whole input row, or (by its engine request id) for one sample of it."""
        self.errors["id"].append(err.id)
        self.errors["error"].append(err.error)
        self.errors["stage"].append(err.stage)
        self.errors["sample_index"].append(None)  # filled in tables() for sample requests
        self.errors["num_samples"].append(None)

    def add_step(self, r) -> None:
        """r: batchgen.engine.StepResult."""
        s = self.steps
        for name in STEPS_SCHEMA.names:
            s[name].append(getattr(r, name))
        tok = self.tokens
        n = len(r.token_request_ids)
        tok["request_id"] += r.token_request_ids
        tok["token_index"] += r.token_indices
        tok["context_len"] += r.token_context_lens
        tok["step_id"] += [r.step_id] * n
        tok["t"] += [r.end_t] * n
        tok["concurrency"] += [r.num_running] * n
        tok["logprob"] += r.token_logprobs or [None] * n
        tok["top_logprobs"] += ([None if t is None else [{"token_id": i, "logprob": lp} for i, lp in t]
                                 for t in r.token_top_logprobs] or [None] * n)
        last = self._last_t
        for rid in r.token_request_ids:
            prev = last.get(rid)
            tok["itl_s"].append(None if prev is None else r.end_t - prev)  # k >= 2 only (METRICS.md)
            last[rid] = r.end_t
        self.num_output_tokens += n
        for f in r.finished:
            self._add_request(f)

    def discard(self, request_ids: list[str]) -> None:
        """Forget the token rows of requests that were aborted unfinished (they will be redone)."""
        drop = set(request_ids)
        if not drop:
            return
        ids = self.tokens["request_id"]
        keep = [i for i, rid in enumerate(ids) if rid not in drop]
        self.num_output_tokens -= len(ids) - len(keep)
        for name, col in self.tokens.items():
            if col:  # token_id stays empty until tables()
                self.tokens[name] = [col[i] for i in keep]
        for rid in drop:
            self._last_t.pop(rid, None)

    def _add_request(self, f) -> None:
        q = self.requests
        n_out = len(f.output_token_ids)
        q["id"].append(f.request_id)
        q["prompt_tokens"].append(f.prompt_tokens)
        q["output_tokens"].append(n_out)
        q["output_token_ids"].append(f.output_token_ids)
        q["text"].append(f.text)
        q["finish_reason"].append(f.finish_reason)
        q["enqueue_t"].append(f.enqueue_t)
        q["schedule_t"].append(f.schedule_t)
        q["first_token_t"].append(f.first_token_t)
        q["last_token_t"].append(f.last_token_t)
        q["queue_s"].append(f.schedule_t - f.enqueue_t)
        q["ttft_s"].append(f.first_token_t - f.enqueue_t)
        q["prefill_s"].append(f.first_token_t - f.schedule_t)
        q["tpot_s"].append((f.last_token_t - f.first_token_t) / (n_out - 1) if n_out >= 2 else None)
        q["e2e_s"].append(f.last_token_t - f.enqueue_t)
        q["prompt_truncated_from"].append(self.truncated.pop(f.request_id, None))
        q["num_cached_tokens"].append(f.num_cached_tokens)
        q["num_preemptions"].append(f.num_preemptions)
        q["seed"].append(self.seeds.pop(f.request_id, None))
        q["request_key"].append(self.keys.pop(f.request_id, None))
        q["reused_from_run"].append(None)
        q["reasoning"].append(f.reasoning)
        q["reasoning_tokens"].append(f.reasoning_tokens)
        q["reasoning_cut"].append(f.reasoning_cut)
        self._last_t.pop(f.request_id, None)

    def _to_rows(self, cols: dict[str, list], id_col: str, num_col: str | None, default_index) -> None:
        """Engine request ids -> input row ids, with each request's sample index (and count)."""
        ids = cols[id_col]
        mapped = [self.samples.get(i) for i in ids]
        cols["sample_index"] = [m[1] if m else default_index for m in mapped]
        if num_col:
            cols[num_col] = [m[2] if m else (1 if default_index == 0 else None) for m in mapped]
        cols[id_col] = [m[0] if m else i for m, i in zip(mapped, ids)]

    def tables(self) -> dict[str, pa.Table]:
        token_ids = self._token_ids()
        self.tokens["token_id"] = token_ids
        self._to_rows(self.requests, "id", "num_samples", 0)
        self._to_rows(self.tokens, "request_id", None, 0)
        self._to_rows(self.errors, "id", "num_samples", None)
        out = {}
        for name, cols in (("requests", self.requests), ("errors", self.errors), ("tokens", self.tokens),
                           ("steps", self.steps)):
            out[name] = pa.table({k: pa.array(v, SCHEMAS[name].field(k).type) for k, v in cols.items()},
                                 schema=SCHEMAS[name])
        for name in ("requests", "errors"):
            ids = out[name].column("id").to_pylist()
            if PROMPT.name not in self.kept_schema.names:  # kept as it is in the input where asked for
                out[name] = out[name].append_column(PROMPT, pa.array([self._prompts.get(i) for i in ids], PROMPT.type))
            for field in self.kept_schema:
                values = [self._kept.get(i, {}).get(field.name) for i in ids]
                out[name] = out[name].append_column(field, pa.array(values, field.type))
        return out

    def _token_ids(self) -> list[int]:
        """Each token row's id, looked up from its finished request's output ids."""
        by_id = dict(zip(self.requests["id"], self.requests["output_token_ids"]))
        return [by_id[rid][i] if rid in by_id else None
                for rid, i in zip(self.tokens["request_id"], self.tokens["token_index"])]
