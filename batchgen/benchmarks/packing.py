"""Batch packing: the paged engine against the slot engine it replaced, in the same run, same KV memory.

    python -m batchgen.benchmarks.packing [--baseline-ref 26452cd] [--workloads concurrency,itl,prefix,startup]

The baseline is batchgen itself at `--baseline-ref` (the last commit with one worst-case slot per
sequence), checked out into a temporary git worktree and run with the same Python environment, so
the two engines differ only in their code. Every run is a real `batchgen generate` process on the
real model and real chat prompts (tests/data), measured from its own run directory:

- concurrency: max_tokens 512 with EOS and a stop string, so answers are far shorter than reserved:
  how many sequences run at once in the same KV memory, and tok/s;
- itl: long prompts keep arriving while others decode: pooled ITL p50, p99 and p99/p50;
- prefix: a labelling job, rows that share a 400-token system prompt and carry a short item (8 words):
  prompt tokens computed (and served from the prefix cache), and tok/s;
- startup: max_num_seqs 256 and one row: process wall time and peak RSS. Every child runs under a
  12 GiB address-space limit, so an engine that allocates for the worst case fails cleanly.

Speed is noisy on a shared machine: read the ratios, printed with the conditions, not one figure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.data.run import RunDir
from batchgen.metrics.conditions import cpu_model

REPO = Path(__file__).resolve().parents[2]
DEFAULT_BASELINE = "26452cd"  # the slot engine: one worst-case KV row per sequence
CHILD_MEMORY_LIMIT = 12 << 30
RSS_PROBE = ("import atexit, runpy, sys\n"
             "def hwm():\n"
             "    for l in open('/proc/self/status'):\n"
             "        if l.startswith('VmHWM'): print('PEAK_RSS_KB', l.split()[1], file=sys.stderr)\n"
             "atexit.register(hwm)\n"
             "sys.argv = ['batchgen'] + sys.argv[1:]\n"
             "runpy.run_module('batchgen.cli', run_name='__main__')\n")


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY_LIMIT, CHILD_MEMORY_LIMIT))


def generate(code_dir: Path, inp: Path, out: Path, run_id: str, args: list[str]) -> dict:
    """One `batchgen generate` process from `code_dir`; its wall time, peak RSS and run directory."""
    env = {**os.environ, "PYTHONPATH": str(code_dir)}
    cmd = [sys.executable, "-c", RSS_PROBE, "generate", "--input", str(inp), "--output", str(out), "--run-id", run_id,
           "--no-progress", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=code_dir, env=env, capture_output=True, text=True, preexec_fn=_limit_memory)
    wall = time.perf_counter() - t0
    rss = next((int(line.split()[1]) / 1024 for line in proc.stderr.splitlines() if line.startswith("PEAK_RSS_KB")), None)
    result = {"wall_s": wall, "peak_rss_mib": rss, "rc": proc.returncode, "run": out / run_id}
    if proc.returncode != 0:
        last = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("PEAK_RSS")]
        result["error"] = (last[-1] if last else f"exit {proc.returncode}")[:160]
    return result


def measure(result: dict) -> dict:
    """Figures from a finished run directory."""
    if result["rc"] != 0:
        return result
    run = RunDir(result["run"])
    steps = run.read_table("steps").to_pylist()
    tokens = run.read_table("tokens", ["itl_s", "concurrency"])
    itl = tokens.column("itl_s").drop_null().to_numpy()
    requests = run.read_table("requests", ["output_tokens"]).column("output_tokens").to_numpy()
    window = max(s["end_t"] for s in steps) - min(s["start_t"] for s in steps)
    result.update(
        peak_running=max(s["num_running"] for s in steps),
        mean_running=float(np.mean(tokens.column("concurrency").to_numpy())),  # as each token saw it
        output_tokens=int(requests.sum()), tok_per_s=float(requests.sum() / window) if window else 0.0,
        prefill_tokens=sum(s["num_prefill_tokens"] for s in steps),
        cached_tokens=sum(s.get("num_cached_tokens") or 0 for s in steps),
        itl_p50=float(np.percentile(itl, 50)) if len(itl) else None,
        itl_p99=float(np.percentile(itl, 99)) if len(itl) else None,
        preemptions=sum(s.get("num_preempted") or 0 for s in steps),
        mean_answer_tokens=float(requests.mean()) if len(requests) else 0.0)
    return result


# ---- workloads ----------------------------------------------------------------------------------

def chat_rows(prompts: list[str], system: str | None = None) -> list:
    return [([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": p}]
            for p in prompts]


def write_messages(path: Path, ids: list[str], messages: list, **extra) -> Path:
    pq.write_table(pa.table({"id": ids, "messages": messages, **extra}), path)
    return path


def workload(name: str, prompts: list[str], tmp: Path) -> tuple[Path, list[str], dict[str, list[str]]]:
    """(input file, common args, per-engine extra args)."""
    common = ["--model", "smollm2-135m", "--dtype", "float32", "--shard-size", "1000"]
    if name == "concurrency":
        inp = write_messages(tmp / "concurrency.parquet", [f"c{i}" for i in range(64)], chat_rows(prompts[:64]))
        return inp, common + ["--max-tokens", "512", "--stop", ".", "--max-num-seqs", "32",
                              "--kv-cache-tokens", "2330", "--max-model-len", "2048"], {}
    if name == "itl":
        longs = [" ".join(prompts[(7 * i + j) % len(prompts)] for j in range(10)) for i in range(16)]
        shorts = prompts[100:108]
        rows = [x for pair in zip(shorts + shorts, longs) for x in pair]  # long prompts keep arriving
        inp = write_messages(tmp / "itl.parquet", [f"i{i}" for i in range(len(rows))], chat_rows(rows),
                             max_tokens=pa.array([48 if i % 2 == 0 else 24 for i in range(len(rows))], pa.int32()))
        return inp, common + ["--ignore-eos", "--max-num-seqs", "8", "--max-model-len", "2048",
                              "--kv-cache-tokens", "16384"], {"paged": ["--max-num-batched-tokens", "64"]}
    if name == "prefix":  # a labelling job: long shared instructions, a short item per row
        system = ("You are a meticulous assistant for a data-labelling team. Label each task by its kind. "
                  "Examples of tasks:\n" + "\n".join(prompts[120:131]))[:1800]  # 401 tokens
        items = [" ".join(p.split()[:8]) for p in prompts[:48]]  # short items: a title, a sentence
        inp = write_messages(tmp / "prefix.parquet", [f"p{i}" for i in range(48)], chat_rows(items, system))
        return inp, common + ["--max-tokens", "16", "--ignore-eos", "--max-num-seqs", "8",
                              "--kv-cache-tokens", "16384", "--max-model-len", "2048"], {}
    if name == "startup":
        inp = write_messages(tmp / "startup.parquet", ["s0"], chat_rows(prompts[:1]))
        return inp, common + ["--max-tokens", "4", "--max-num-seqs", "256", "--max-model-len", "2048"], {}
    raise ValueError(f"unknown workload {name!r}")


def _fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def _ratio(a, b):
    return "-" if not a or not b else f"{a / b:.2f}x"


def report(name: str, rows: dict[str, dict]) -> str:
    base, new = rows["baseline"], rows["paged"]
    head = f"\n== {name} =="
    if name == "startup":
        lines = [f"{'engine':<24}{'result':<44}{'wall s':>8}{'peak RSS MiB':>14}"]
        for k, r in rows.items():
            lines.append(f"{k:<24}{('ok' if r['rc'] == 0 else 'failed: ' + r.get('error', ''))[:43]:<44}"
                         f"{r['wall_s']:>8.1f}{_fmt(r['peak_rss_mib'], '.0f'):>14}")
        return "\n".join([head, *lines])
    cols = [("peak running", "peak_running", "d"), ("running/token", "mean_running", ".1f"),
            ("tok/s", "tok_per_s", ".1f"), ("prefill tok", "prefill_tokens", "d"), ("cached tok", "cached_tokens", "d"),
            ("ITL p50 s", "itl_p50", ".3f"),
            ("ITL p99 s", "itl_p99", ".3f"), ("preempt", "preemptions", "d"), ("wall s", "wall_s", ".1f")]
    lines = [f"{'engine':<24}" + "".join(f"{c[0]:>14}" for c in cols) + f"{'p99/p50':>9}"]
    for k, r in rows.items():
        if r["rc"] != 0:
            lines.append(f"{k:<24}failed: {r.get('error')}")
            continue
        lines.append(f"{k:<24}" + "".join(f"{_fmt(r.get(c[1]), c[2]):>14}" for c in cols)
                     + f"{_ratio(r['itl_p99'], r['itl_p50']):>9}")
    if base["rc"] == 0 and new["rc"] == 0:
        lines.append(f"paged / baseline: peak running {_ratio(new['peak_running'], base['peak_running'])}, "
                     f"running per token {_ratio(new['mean_running'], base['mean_running'])}, "
                     f"tok/s {_ratio(new['tok_per_s'], base['tok_per_s'])}, "
                     f"prefill tokens {_ratio(new['prefill_tokens'], base['prefill_tokens'])}")
    return "\n".join([head, *lines])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-ref", default=DEFAULT_BASELINE)
    p.add_argument("--workloads", default="concurrency,itl,prefix,startup")
    p.add_argument("--prompts", default=str(REPO / "tests" / "data" / "alpaca_seed_prompts.parquet"))
    args = p.parse_args(argv)
    prompts = pq.read_table(args.prompts, columns=["prompt"]).column("prompt").to_pylist()
    print(f"batch packing benchmark: paged engine ({REPO}) vs slot engine at {args.baseline_ref}; "
          f"SmolLM2-135M fp32 on {cpu_model()}, {os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M')}; one run each")
    with tempfile.TemporaryDirectory(prefix="bg-packing-") as tmpd:
        tmp = Path(tmpd)
        base_dir = tmp / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base_dir), args.baseline_ref],
                       check=True, capture_output=True)
        try:
            for name in [w.strip() for w in args.workloads.split(",") if w.strip()]:
                inp, common, extra = workload(name, prompts, tmp)
                rows = {}
                engines = [("baseline", base_dir, []), ("paged", REPO, [])]
                if name == "prefix":
                    engines.append(("paged, no prefix cache", REPO, ["--no-prefix-caching"]))
                for label, code, more in engines:
                    key = "baseline" if label == "baseline" else "paged"
                    r = generate(code, inp, tmp / "runs", f"{name}-{label.replace(' ', '_').replace(',', '')}",
                                 common + extra.get(key, []) + more)
                    rows[label] = measure(r)
                print(report(name, rows), flush=True)
                print("conditions: " + json.dumps({"args": common, "per_engine": extra}), flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_dir)], capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
