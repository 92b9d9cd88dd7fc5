"""`python -m batchgen.benchmarks.judge`: the engine's speed targets on this machine, measured and tabled.

    run    the series of runs that measure every target, one after another, each in its own process
           and each writing its Parquet into one folder (default runs/targets-<time>/), then their table:
             fp32     batch 64 and 256, native fp32 (compiled) against vLLM's `LLM.generate` in fp32
             bf16     the same in bf16, native `--dtype auto`; left out where the probe finds no bf16 math
                      (there vLLM's bf16 matmuls crawl: hours a run)
             batch1   batch 1, `--dtype auto` against llama.cpp on the model's GGUF (decode steps), and MBU
             prefill  64 prompts of 300 tokens, prefill MFU against the matmul peak in the chosen dtype,
                      measured beside each repeat
             wrapper  `--engine vllm` through batchgen against vLLM's own `generate` (vllm_wrapper)
           Each cell is the median of --repeats with the engines taking turns (batchgen bench).
    table  the targets judged on any bench runs' Parquet files (`batchgen bench --out`, `vllm_wrapper
           --out`), as one Markdown table: a row a target and run, with the CPU, the run's date and
           repeats, both figures and the verdict; then each CPU's flags.

The verdicts are bench_results.verdicts, the ones `batchgen bench` prints under its table. The whole
series takes about an hour on 2 cores; llama.cpp needs the peers extra (`pip install -e ".[peers]"`)
and vLLM the cpu extra, and a peer that is not installed is left out of its run with a line.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from batchgen.benchmarks.bench_results import Verdict, read_results, verdicts
from batchgen.benchmarks.peers import cpu_ids
from batchgen.config import DEFAULT_MODEL

STEPS = ("fp32", "bf16", "batch1", "prefill", "wrapper", "vllm-default", "one-core")


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]  # the command, run with this Python
    out: Path  # the Parquet it writes


def series(out_dir: Path, bf16_math: bool, model: str = DEFAULT_MODEL, repeats: int = 3,
           only: tuple[str, ...] = STEPS, batches: str = "64,256") -> tuple[list[Step], list[str]]:
    """The runs that measure the targets, and a line for each one left out (and why); `batches`: the
    widths of the fp32 and bf16 steps."""
    bench = [sys.executable, "-m", "batchgen.cli", "bench", "--model", model, "--modes", "greedy", "--repeats",
             str(repeats), "--speculative", "0"]
    dtype = "bfloat16" if bf16_math else "float32"
    # the native row judged is `default` (generate's default flags); where those take bf16, the fp32
    # comparison needs a float32 row too: the compiled fp32 step (its flags named in the verdict)
    fp32_native = "default,compiled" if bf16_math else "default"
    plan = {
        "fp32": [*bench, "--engines", "native,vllm-generate:fp32", "--native-variants", fp32_native,
                 "--batches", batches],
        "bf16": [*bench, "--engines", "native,vllm-generate:bf16", "--native-variants", "default",
                 "--batches", batches],
        # the batch-1 target asks for at least 5 runs; beside generate's defaults (weights chosen by the
        # machine, the same at every batch), `--quantization gguf`: the model's Q4_1 blocks, as llama.cpp's
        "batch1": [*bench, "--engines", "native,llama.cpp", "--native-variants", "default,gguf", "--batches", "1",
                   "--repeats", str(max(repeats, 5))],
        "prefill": [*bench, "--engines", "native", "--native-variants", "default", "--batches", "64",
                    "--prompt-tokens", "300"],
        "wrapper": [sys.executable, "-m", "batchgen.benchmarks.vllm_wrapper", "--model", model, "--dtype", dtype,
                    "--repeats", str(repeats)],
        # vLLM's own binding (a core reserved for its scheduler) beside native: shown, never judged
        "vllm-default": [*bench, "--engines", "native,vllm-generate:fp32:default", "--native-variants", "default",
                         "--batches", "64"],
        # both engines on one core (taskset): native's and vLLM's scaling from one core to all
        "one-core": ["taskset", "-c", str(min(os.sched_getaffinity(0))), *bench, "--engines",
                     "native,vllm-generate:fp32", "--native-variants", "default", "--batches", "64"],
    }
    steps, skipped = [], []
    for name in only:
        if name not in plan:
            raise ValueError(f"unknown step {name!r}: the steps are {', '.join(STEPS)}")
        if name == "bf16" and not bf16_math:
            skipped.append("bf16: left out, the probe finds no bf16 math on this CPU (its bf16 matmul peak is under "
                           "its fp32 one), so vLLM's bf16 would crawl; --dtype auto takes float32 here")
            continue
        out = out_dir / f"{name}.parquet"
        steps.append(Step(name, [*plan[name], "--out", str(out)], out))
    return steps, skipped


def has_bf16_math(probe: dict) -> bool:
    """bf16 matmuls at least as fast as fp32's, as measured by the probe (AVX512-BF16, AMX or Arm's BF16)."""
    return (probe.get("peak_flops_bfloat16") or 0) >= (probe.get("peak_flops_fp32") or float("inf"))


def run_series(steps: list[Step], log_dir: Path, echo=print) -> list[str]:
    """Run each step in turn (its output shown and kept in <step>.log); the ones that failed."""
    log_dir.mkdir(parents=True, exist_ok=True)
    failed = []
    for step in steps:
        echo(f"== {step.name}: {' '.join(step.argv[1:])}")
        step.out.unlink(missing_ok=True)  # a file left by an earlier run is not this one's
        t0 = time.perf_counter()
        with open(log_dir / f"{step.name}.log", "w") as log:
            proc = subprocess.Popen(step.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for line in proc.stdout:
                log.write(line)
                echo(line.rstrip("\n"))
            rc = proc.wait()
        echo(f"== {step.name}: exit {rc} after {time.perf_counter() - t0:.0f} s")
        if rc != 0 or not step.out.is_file():
            failed.append(f"{step.name} (exit {rc}; its log: {log_dir / (step.name + '.log')})")
    return failed


# AMD's families and models, by core (from AMD's processor programming references); an unknown one
# keeps its family and model only
def _zen(family: int, model: int) -> str | None:
    if family == 23:
        return "Zen 2" if model >= 0x30 else "Zen"
    if family == 25:
        return "Zen 4" if 0x10 <= model <= 0x1F or 0x60 <= model <= 0x7F or 0xA0 <= model <= 0xAF else "Zen 3"
    if family == 26:
        return "Zen 5"
    return None


def cpu_label(conditions: dict) -> str:
    """A short name for the run's CPU: its model name, AMD's core where known, the family and model,
    and a cap where the run capped its instruction set (e.g. "AMD EPYC, Zen 3 (family 25 model 1)")."""
    name = re.sub(r"\((R|TM)\)|\b(Processor|CPU)\b|@.*|\b\d+-Core\b", "", conditions.get("cpu", "")).split()
    features = conditions.get("cpu_features", "")
    m = re.match(r"(\S+) family (\d+) model (\d+)", features)
    if not m:
        return " ".join(name[:3]) or "?"
    short = " ".join(name[:2]) or m[1]
    zen = _zen(int(m[2]), int(m[3])) if m[1] == "AMD" else None
    cap = re.search(r"capped to (\S+)", features)
    return (f"{short}{', ' + zen if zen else ''} (family {m[2]} model {m[3]})"
            + (f", capped to {cap[1]}" if cap else ""))


def _score(v: Verdict) -> str:
    if not v.equal_work:
        return f"{v.score:.2f}{v.kind if v.kind == 'x' else ''} (not judged: not equal work)"
    if v.kind == "x" and not v.goal:  # shown, not judged
        return f"{v.score:.2f}x (not judged)"
    if v.kind == "x":
        return f"**{v.score:.2f}x** ({v.goal}x: {v.verdict})"
    return f"**{v.kind} {v.score:.2f}** ({v.goal}: {v.verdict})"


def _cell(results, engine: str, batch: int):
    return next((m for m in results if m.section == "grid" and (m.engine, m.batch, m.mode) == (engine, batch, "greedy")),
                None)


def _cores(c: dict) -> int:
    """How many CPUs a run's engines computed on (older runs recorded only the machine's count)."""
    used = c.get("cores_used")
    return len(cpu_ids(used)) if used else int(c.get("cores") or 0)


def shown(results, c: dict) -> list[Verdict]:
    """Rows shown beside the targets, never judged: native against vLLM on its own default binding (one
    core reserved for its scheduler), where a run measured it."""
    out = []
    for m in results:
        if m.section == "grid" and m.mode == "greedy" and m.engine.startswith("vllm-generate:") \
                and m.engine.endswith(":default"):
            mine = _cell(results, "native:default", m.batch)
            if mine:
                out.append(Verdict(f"batch {m.batch}, {m.dtype}, vLLM on its default cores (shown, not judged)",
                                   f"{mine.tok_per_s:.1f} tok/s ({mine.engine}, cores {mine.cores})",
                                   f"vLLM `generate` {m.tok_per_s:.1f}, {m.cores}", mine.tok_per_s / m.tok_per_s,
                                   0.0, "x", "", (mine, m)))
    return out


def _when(c: dict) -> float:
    try:
        return time.mktime(time.strptime(c.get("date", "")[:19], "%Y-%m-%d %H:%M:%S"))
    except ValueError:
        return 0.0


def scaling(runs: list[tuple]) -> list[tuple[str, Verdict]]:
    """Native on all its cores against native on one, per CPU (the one-core step beside the run of the same
    workload and batch on more cores nearest it in time), with vLLM's own scaling in the peer column:
    (CPU label, verdict)."""
    out = []
    for label in sorted({r[0] for r in runs}):
        mine = [(c, results) for lab, _, c, _, _, results in runs if lab == label]
        one = [(c, r) for c, r in mine if _cores(c) == 1]
        many = [(c, r) for c, r in mine if _cores(c) > 1]
        for c1, r1 in one:
            for b in sorted({m.batch for m in r1 if m.section == "grid"}):
                n1 = _cell(r1, "native:default", b)
                same = [(c, r) for c, r in many  # the same workload: prompts and new tokens
                        if (c.get("prompts"), c.get("new_tokens")) == (c1.get("prompts"), c1.get("new_tokens"))]
                wide = [(c, _cell(r, "native:default", b), _cell(r, "vllm-generate:fp32", b)) for c, r in same]
                wide = [w for w in wide if w[1] and w[1].dtype == (n1.dtype if n1 else None)]
                if not n1 or not wide:
                    continue
                # the run nearest in time (its series' own), among those with vLLM on the same cores if any
                cn, nn, vn = min(wide, key=lambda w: (w[2] is None, abs(_when(w[0]) - _when(c1))))
                v1 = _cell(r1, "vllm-generate:fp32", b)
                peer = (f"vLLM `generate` {vn.tok_per_s:.1f} on {_cores(cn)} cores / {v1.tok_per_s:.1f} on 1: "
                        f"{vn.tok_per_s / v1.tok_per_s:.2f}x" if vn and v1 else "vLLM not measured on both")
                r = nn.tok_per_s / n1.tok_per_s
                out.append((label, Verdict(f"batch {b}, {nn.dtype}, native on {_cores(cn)} cores / on 1",
                                           f"{nn.tok_per_s:.1f} tok/s / {n1.tok_per_s:.1f} ({nn.engine})", peer,
                                           r, 1.8, "x", "", (nn,))))
    return out


def table(paths: list[Path]) -> str:
    """The targets judged on these runs: one Markdown table, a row a target and run, CPU by CPU and in
    time order, each with the repeats behind it and the range of its ratio over them; rows shown but
    not judged (vLLM on its own default binding) and each CPU's scaling from one core; then each
    CPU's flags and threads, and the files it was made from."""
    runs = []
    for path in paths:
        results, c = read_results(path)
        runs.append((cpu_label(c), c.get("date", "?"), c, path, verdicts(results, c) + shown(results, c), results))
    runs.sort(key=lambda r: (r[0], r[1]))
    lines = ["| CPU | workload | run | batchgen | peer | batchgen / peer (target) | over the repeats |",
             "|---|---|---|---|---|---|---|"]
    machines: dict[str, str] = {}

    def row(label: str, when: str, v: Verdict, c: dict) -> str:
        reps = v.repeats or c.get("repeats", 1)
        low_high = v.repeat_range
        return (f"| {label} | {v.workload} | {when}, " + ("one run" if reps == 1 else f"median of {reps}")
                + f" | {v.native} | {v.peer} | {_score(v)} | "
                + (f"{low_high[0]:.2f}-{low_high[1]:.2f}x" if low_high else "") + " |")

    for label, date, c, path, vs, _ in runs:
        machines.setdefault(label, f"{c.get('cpu_features', '?')}; {c.get('cores', '?')} cores, torch threads "
                                   f"{c.get('torch_threads', '?')}")
        lines += [row(label, date[:16], v, c) for v in vs]
    lines += [row(label, "one-core run against the wider one nearest in time", v, {}) for label, v in scaling(runs)]
    if len(lines) == 2:
        lines.append("| | no target is judged on these runs | | | | | |")
    lines += ["", *(f"- {label}: {flags}" for label, flags in machines.items()),
              f"- made by `python -m batchgen.benchmarks.judge table` from {', '.join(map(str, paths))}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="measure every target here, then print their table")
    run.add_argument("--out", help="the folder for the runs' Parquet and logs (default runs/targets-<time>)")
    run.add_argument("--only", default=",".join(STEPS), help=f"the steps to run, comma-separated: {', '.join(STEPS)}")
    run.add_argument("--repeats", type=int, default=3)
    run.add_argument("--model", default=DEFAULT_MODEL)
    run.add_argument("--batches", default="64,256", help="the widths of the fp32 and bf16 steps (comma-separated)")
    tab = sub.add_parser("table", help="the targets judged on bench runs' Parquet files, as a Markdown table")
    tab.add_argument("files", nargs="+", type=Path)
    args = p.parse_args(argv)

    if args.cmd == "table":
        missing = [f for f in args.files if not f.is_file()]
        if missing:
            p.error(f"no such file: {missing[0]}")
        print(table(args.files))
        return 0
    from batchgen.metrics.probe import cached_probe

    out_dir = Path(args.out or f"runs/targets-{time.strftime('%Y%m%d-%H%M%S')}")
    only = tuple(s.strip() for s in args.only.split(",") if s.strip())
    try:
        steps, skipped = series(out_dir, has_bf16_math(cached_probe("cpu")), args.model, args.repeats, only,
                                args.batches)
    except ValueError as e:
        p.error(str(e))
    for line in skipped:
        print(line)
    (out_dir / "targets.md").unlink(missing_ok=True)
    failed = run_series(steps, out_dir)
    done = [s.out for s in steps if s.out.is_file()]
    if done:
        text = table(done)
        (out_dir / "targets.md").write_text(text + "\n")
        print(f"\n{text}\n\nthe table: {out_dir / 'targets.md'}")
    for line in failed:
        print(f"failed: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
