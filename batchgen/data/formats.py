"""Input and output formats besides Parquet: JSONL rows, and the OpenAI Batch API's files.

JSONL input holds one JSON object per line with the same columns as a Parquet input (`prompt` or
`messages`, `id`, `max_tokens`, ...). The OpenAI Batch input format (also `vllm run-batch`'s) is
recognised by its fields: each line is
    {"custom_id": ..., "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
     "body": {"messages" | "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "n",
              "response_format", "model", ...}}
and becomes a row with id = custom_id and the body's fields as columns (response_format as its JSON
text). A line that is not JSON, or an OpenAI line without a body, is an InputError naming the line.

`write_openai_batch` writes the matching output and error files, line for line as the Batch API
does, from a finished run's tables: one output line per request (its n samples as n choices), and
one error-file line per input row that failed.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pyarrow as pa

from batchgen.data.errors import InputError

OPENAI_BODY_FIELDS = ("messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
                      "stop", "n", "response_format", "logprobs", "top_logprobs", "top_k")


def is_jsonl(name: str) -> bool:
    return name.endswith((".jsonl", ".ndjson", ".jsonl.gz"))


def read_jsonl(data: bytes, where: str) -> pa.Table:
    """A JSONL file's rows as a table (OpenAI Batch lines mapped to batchgen's columns)."""
    rows: list[dict[str, Any]] = []
    openai = None
    for n, line in enumerate(data.decode("utf-8", errors="strict").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: line {n} is not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise InputError(f"{where}: line {n} is not a JSON object")
        if openai is None:
            openai = "custom_id" in obj and "body" in obj
        rows.append(_openai_row(obj, where, n) if openai else obj)
    if not rows:
        return pa.table({"prompt": pa.array([], pa.string())})
    if not openai:
        for r in rows:  # nested values Arrow cannot unify stay JSON text, as a Parquet writer would need
            if isinstance(r.get("response_format"), dict):
                r["response_format"] = json.dumps(r["response_format"])
    keys = list(dict.fromkeys(k for r in rows for k in r))  # every line's fields, not only the first's
    try:
        return pa.table({k: pa.array([r.get(k) for r in rows]) for k in keys})
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise InputError(f"{where}: the lines' fields do not agree in type ({str(e).splitlines()[0]})") from None


def _openai_row(obj: dict[str, Any], where: str, n: int) -> dict[str, Any]:
    body = obj.get("body")
    if not isinstance(body, dict):
        raise InputError(f"{where}: line {n} (custom_id {obj.get('custom_id')!r}) has no body object")
    row: dict[str, Any] = {"id": str(obj["custom_id"])}
    for k in OPENAI_BODY_FIELDS:
        if k in body and body[k] is not None:
            row[k] = body[k]
    if "max_completion_tokens" in row:  # the chat API's newer name
        row.setdefault("max_tokens", row.pop("max_completion_tokens"))
    if isinstance(row.get("stop"), str):
        row["stop"] = [row["stop"]]
    if "response_format" in row:
        row["response_format"] = json.dumps(row["response_format"])
    if "messages" in row:
        row["messages"] = json.dumps(row["messages"])  # one type for every line, read like a JSON column
    if row.pop("logprobs", None) is True:  # chat: logprobs=true with top_logprobs=k
        row["logprobs"] = int(row.pop("top_logprobs", 0) or 0)
    else:
        row.pop("top_logprobs", None)
    return row


# ---- output ------------------------------------------------------------------------------------------

def write_openai_batch(requests: pa.Table, errors: pa.Table, model: str, chat: bool = True,
                       order: list[str] | None = None) -> tuple[bytes, bytes]:
    """(output.jsonl, errors.jsonl) in the Batch API's shape: chat completions for `messages`
    inputs, text completions (/v1/completions) for `prompt` inputs; lines in input order (`order`:
    the input's ids), though a reader should match them by custom_id, as with the Batch API."""
    created = int(time.time())
    by_id: dict[str, list[dict[str, Any]]] = {}
    for r in requests.to_pylist():
        by_id.setdefault(r["id"], []).append(r)
    rank = {rid: i for i, rid in enumerate(order or [])}
    out_lines = []
    for rid, samples in sorted(by_id.items(), key=lambda kv: rank.get(kv[0], len(rank))):
        samples.sort(key=lambda s: s.get("sample_index") or 0)
        choices = []
        for i, s in enumerate(samples):
            c: dict[str, Any] = {"index": i, "finish_reason": s["finish_reason"], "logprobs": None}
            if chat:
                c["message"] = {"role": "assistant", "content": s["text"]}
            else:
                c["text"] = s["text"]
            choices.append(c)
        prompt_tokens = samples[0]["prompt_tokens"]
        completion = sum(s["output_tokens"] for s in samples)
        body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{_short(rid)}",
                "object": "chat.completion" if chat else "text_completion", "created": created, "model": model,
                "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                          "total_tokens": prompt_tokens + completion}}
        out_lines.append({"id": f"batch_req_{_short(rid)}", "custom_id": rid,
                          "response": {"status_code": 200, "request_id": _short(rid, "req"), "body": body},
                          "error": None})
    err_lines = []
    for e in sorted(errors.to_pylist(), key=lambda e: (rank.get(e["id"], len(rank)), e.get("sample_index") or 0)):
        err_lines.append({"id": f"batch_req_{_short(e['id'])}", "custom_id": e["id"],
                          "response": {"status_code": 400, "request_id": _short(e["id"], "req"),
                                       "body": {"error": {"message": e["error"], "type": "invalid_request_error",
                                                          "param": None, "code": e.get("stage")}}},
                          "error": None})
    dump = lambda lines: "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines).encode()  # noqa: E731
    return dump(out_lines), dump(err_lines)


def _short(rid: str, salt: str = "") -> str:
    import hashlib

    return hashlib.sha256(f"{salt}|{rid}".encode()).hexdigest()[:24]
