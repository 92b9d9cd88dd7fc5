"""The data path at scale on an object store: a 1-million-row input streamed from a local S3 server
(moto in server mode) through `batchgen generate` to output on it, next to the same run on local disk.

    python -m batchgen.benchmarks.object_store --rows 1000000

The engine is a test double, `EchoEngine`, that answers every request with one token in the step
it arrives: the figures are reading, validation, tokenisation, shard commits (data files, manifests,
leases) and the final exactly-once check, not generation. Prints rows/s and peak RSS for each store,
and the ratio, with the conditions. AWS_ENDPOINT_URL set: that server is used instead of starting one.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from batchgen.config import DEFAULT_MODEL, SamplingParams
from batchgen.engine.base import Engine, FinishedRequest, StepResult


class EchoEngine(Engine):
    """Test double: every request finishes in the step after it was added, with one token."""

    name = "echo"

    def __init__(self, tokenizer, max_model_len: int = 4096):
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self._pending: list[tuple[str, int]] = []
        self._step = 0

    def add(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        self._pending.append((request_id, len(prompt_token_ids)))

    def has_unfinished(self) -> bool:
        return bool(self._pending)

    def step(self) -> StepResult:
        self._step += 1
        t = time.monotonic()
        done, self._pending = self._pending, []
        res = StepResult(self._step, t, t, len(done), 0, sum(n for _, n in done), 0, 0, 0)
        for rid, n in done:
            res.token_request_ids.append(rid)
            res.token_indices.append(0)
            res.token_context_lens.append(n)
            res.finished.append(FinishedRequest(rid, n, [0], "", "length", t, t, t, t))
        return res

    def abort_all(self) -> list[str]:
        dropped, self._pending = [r for r, _ in self._pending], []
        return dropped

    def conditions(self) -> dict[str, Any]:
        return {"engine": "echo (test double: one token per request, no model)"}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one_run(inp: str, out: str, model: str, shard_size: int) -> dict:
    """In a fresh process, so peak RSS is this run's."""
    code = f"""
import json, time
import batchgen.runner as runner
from batchgen.worker import Worker
from batchgen.benchmarks.object_store import EchoEngine, peak_rss_mib
from batchgen.config import RunConfig, SamplingParams
from batchgen.model.tokenizer import Tokenizer
worker = Worker(create=lambda name, model_dir, *a, **kw: EchoEngine(Tokenizer(model_dir)))  # the double
cfg = RunConfig(inputs=({inp!r},), output_dir={out!r}, model={model!r}, run_id="bench", shard_size={shard_size},
                sampling=SamplingParams(max_tokens=1), progress=False)
t0 = time.perf_counter()
s = runner.generate(cfg, probe=False, worker=worker)
print(json.dumps({{"rows": s.rows, "seconds": time.perf_counter() - t0, "peak_rss_mib": peak_rss_mib()}}))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    import json

    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--shard-size", type=int, default=50_000)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    args = ap.parse_args()
    from batchgen.benchmarks.reader_stream import write_dataset
    from batchgen.data.fs import filesystem
    from batchgen.metrics.conditions import cpu_model
    from batchgen.model.prepare import resolve_model

    server = None
    if not os.environ.get("AWS_ENDPOINT_URL"):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                          AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
        time.sleep(3)
    model = str(resolve_model(args.model))
    try:
        with tempfile.TemporaryDirectory() as d:
            local_in = Path(d) / "prompts.parquet"
            write_dataset(local_in, args.rows)
            fs, _ = filesystem("s3://bench")
            if not fs.exists("bench"):
                fs.mkdir("bench")
            fs.put_file(str(local_in), "bench/in/prompts.parquet")
            size = local_in.stat().st_size
            results = {"local disk": one_run(str(local_in), str(Path(d) / "runs"), model, args.shard_size),
                       "S3 (moto, 127.0.0.1)": one_run("s3://bench/in/prompts.parquet", "s3://bench/runs", model,
                                                       args.shard_size)}
    finally:
        if server is not None:
            server.terminate()
    print(f"{args.rows} rows ({size / 2**20:.0f} MiB Parquet), shards of {args.shard_size}, echo engine double; "
          f"{cpu_model()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}")
    base = None
    for name, r in results.items():
        rate = r["rows"] / r["seconds"]
        base = base or rate
        print(f"{name:<22} {rate:>10.0f} rows/s  {r['seconds']:7.1f} s  peak RSS {r['peak_rss_mib']:6.0f} MiB  "
              f"({rate / base:.2f}x local)")


if __name__ == "__main__":
    main()
