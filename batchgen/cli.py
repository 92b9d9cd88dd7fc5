"""`batchgen generate | estimate | report | bench | lab decode | model prepare`."""

from __future__ import annotations

import argparse
import json
import os
import sys

from batchgen.budget import BudgetReached
from batchgen.config import DEFAULT_MODEL, cap_cpu_libraries


def _generate_parser(sub) -> None:
    from batchgen.settings_cli import add_settings_flags

    p = sub.add_parser("generate", help="generate outputs for a Parquet prompt dataset",
                       usage="batchgen generate --input PATH [--output DIR] [--model MODEL] [--max-tokens N] "
                             "[options]",
                       description="Generate one output row per input row (per sample); flags override --config.")
    add_settings_flags(p)


def _estimate_parser(sub) -> None:
    from batchgen.settings_cli import add_settings_flags

    p = sub.add_parser("estimate", help="rows, tokens, time and cost of a generate command, before it runs",
                       usage="batchgen estimate --input PATH [generate's flags] [--history RUN ...] [--json]",
                       description="Take generate's flags; count rows and prompt tokens exactly, the rows "
                                   "--reuse-from would copy, the output tokens to expect, and the time and cost "
                                   "from a short probe at the run's settings (or from earlier runs).")
    own = p.add_argument_group("estimate")
    own.add_argument("--history", nargs="+", default=[], metavar="RUN",
                     help="earlier run directories: their mean output tokens a row (and, with --no-probe, their "
                          "rates)")
    own.add_argument("--probe-tokens", type=int, default=32, help="tokens each probe row decodes (default 32)")
    own.add_argument("--probe-rows", type=int, default=64,
                     help="the probe's batch: the input's first rows, at most --max-num-seqs (default 64)")
    own.add_argument("--no-probe", action="store_true", help="no probe: the --history runs' rates")
    own.add_argument("--json", action="store_true", help="print the estimate as one JSON object")
    add_settings_flags(p)


def _settings(args):
    """GenerateSettings from the flags, over --config's (GenerateSettings merges the file: flags win,
    KEY=VALUE flags add to the file's mapping)."""
    from batchgen.settings import GenerateSettings
    from batchgen.settings_cli import settings_values

    return GenerateSettings(**settings_values(args))


def cmd_estimate(args) -> int:
    from batchgen.estimate import estimate

    if args.probe_tokens < 2 or args.probe_rows < 1:
        raise ValueError("--probe-tokens must be at least 2 and --probe-rows at least 1")
    est = estimate(_settings(args).to_run_config(), tuple(args.history), args.probe_tokens, not args.no_probe,
                   args.probe_rows)
    print(json.dumps(est.to_json(), indent=2, default=str) if args.json else est.format())
    return 0


def cmd_generate(args) -> int:
    from batchgen.runner import generate

    settings = _settings(args)

    def started(opened) -> None:
        print(f"batchgen: run {opened.run.path}{' (resuming)' if opened.resumed else ''}; "
              f"resume with --run-id {opened.run.name}", file=sys.stderr)
        shards = "1 shard" if opened.num_shards == 1 else f"{opened.num_shards} shards"
        print(f"batchgen: {shards} of up to {opened.cfg.shard_size} rows, in "
              f"{'prefix order' if opened.shard_by == 'prefix' else 'input order'} ({opened.shard_by_why}); "
              f"plain prompts sent {_prompt_format_words(opened.cfg.prompt_format)} (--prompt-format "
              f"{opened.cfg.prompt_format})", file=sys.stderr)

    cfg = settings.to_run_config()
    summary = generate(cfg, on_start=started)
    rate = summary.output_tokens / summary.wall_s if summary.wall_s else 0.0
    reused = f" ({summary.reused} reused, {summary.ok - summary.reused} generated)" if summary.reused else ""
    plural = "" if summary.shards == 1 else "s"
    print(f"run {summary.run_dir}: {summary.rows} rows -> {summary.ok} outputs{reused}, {summary.errors} errors, "
          f"{summary.shards} shard{plural}{' (resumed)' if summary.resumed else ''}; "
          f"{summary.output_tokens} tokens generated in {summary.wall_s:.1f}s ({rate:.1f} tok/s incl. start-up)")
    for line in summary.notes():
        print(f"  {line}")
    for line in summary.warnings():
        print(f"batchgen: warning: {line}", file=sys.stderr)
    print(where_outputs_are(summary.run_dir, summary.output_format))
    return 0


def _prompt_format_words(fmt: str) -> str:
    return {"chat": "as user messages through the model's chat template", "raw": "as is (no chat template)",
            "auto": "as user messages through the model's chat template, unless already rendered"}[fmt]


def where_outputs_are(run_dir: str, output_format: str = "parquet") -> str:
    """The lines that end a run: where its outputs are, and the next commands."""
    from batchgen.data.fs import join

    lines = [f"  outputs: {join(run_dir, 'requests')}/ (Parquet: id, text, finish_reason, ...); failed rows: "
             f"{join(run_dir, 'errors')}/"]
    if output_format == "openai-batch":
        lines.append(f"  OpenAI Batch files: {join(run_dir, 'batch_output.jsonl')}, {join(run_dir, 'batch_errors.jsonl')}")
    lines += [f"  read them: duckdb -c \"select id, text from read_parquet('{join(run_dir, 'requests')}/**/*.parquet') "
              f"limit 5\"",
              f"  report:    batchgen report {run_dir}"]
    return "\n".join(lines)


def cmd_report(args) -> int:
    from pathlib import Path

    from batchgen.report.build import build_report, default_report_dir, headline_text

    if args.out is None and len(args.run_dirs) != 1:
        raise ValueError("several runs: say where the report goes with --out DIR")
    out = Path(args.out) if args.out else default_report_dir(args.run_dirs[0])
    results = build_report(args.run_dirs, out, window_s=args.window_s, memory_limit=args.memory_limit,
                           price_per_hour=args.price_per_hour)
    print(headline_text(results))
    print(f"\nreport: {out / 'report.html'} (+ one Parquet and CSV file per query in {out})")
    return 0


def cmd_bench(args) -> int:
    import time
    from pathlib import Path

    from batchgen.benchmarks.bench import run_bench
    from batchgen.benchmarks.bench_results import format_bench, write_parquet
    from batchgen.model.prepare import resolve_model

    def csv(text: str) -> list[str]:
        return [e.strip() for e in text.split(",") if e.strip()]

    results, conditions = run_bench(resolve_model(args.model), csv(args.engines), [int(b) for b in csv(args.batches)],
                                    csv(args.modes), args.new_tokens, args.speculative, args.spec_batch,
                                    repeats=args.repeats, native_variants=tuple(csv(args.native_variants)),
                                    prompt_tokens=args.prompt_tokens)
    print(format_bench(results, conditions))
    out = Path(args.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}.parquet")
    print(f"\nresults: {write_parquet(results, conditions, out)}")
    return 0


def cmd_lab(args) -> int:
    from batchgen.benchmarks.lab import format_lab, run_decode_lab
    from batchgen.model.prepare import resolve_model

    results = run_decode_lab(resolve_model(args.model), args.prompt_tokens, args.new_tokens, args.device)
    print(format_lab(results, args.prompt_tokens, args.new_tokens))
    return 0


def cmd_prepare(args) -> int:
    from batchgen.model.prepare import prepare_default

    print(prepare_default(force=args.force))
    return 0


def cmd_kernels(args) -> int:
    from batchgen import kernels

    print("\n".join(kernels.build_all(args.names or kernels.NAMES)))
    return 0  # a kernel that cannot be built is not an error: the torch / oneDNN path serves


class Parser(argparse.ArgumentParser):
    """argparse, with errors a person can act on: one line from the subcommand that was called (no
    usage block), naming the flag or value and the nearest valid one; and no prefix matching (a flag
    spelled short is an error, not silently another flag)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        import difflib
        import re

        hint = ""
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            options = [c.strip(" '") for c in choice[2].split(",")]
            near = difflib.get_close_matches(choice[1], options, n=1, cutoff=0.3)
            hint = f"; did you mean {near[0]!r}?" if near else ""
        self.exit(2, f"{self.prog}: error: {message}{hint} (--help lists them)\n")

    def unknown(self, extras: list[str]):
        """Unrecognized arguments, each with the nearest flag this (sub)command has."""
        import difflib

        flags = [o for a in self._actions for o in a.option_strings]
        groups: list[list[str]] = []  # an unknown flag with the values that followed it
        for arg in extras:
            if arg.startswith("-") or not groups:
                groups.append([arg])
            else:
                groups[-1].append(arg)
        parts = []
        for flag, *values in groups:
            near = difflib.get_close_matches(flag.split("=", 1)[0], flags, n=1, cutoff=0.6) if flag.startswith("-") else []
            parts.append(" ".join([flag, *values]) + (f" (did you mean {near[0]}?)" if near else ""))
        self.error(f"unrecognized argument{'s' if len(groups) > 1 else ''}: {', '.join(parts)}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with an unrecognized flag reported by the subcommand it was given to."""
    parser, commands = build_parser(with_commands=True)
    args, extras = parser.parse_known_args(argv)
    if extras:
        commands.get(getattr(args, "command", None), parser).unknown(extras)
    return args


def build_parser(with_commands: bool = False):
    parser = Parser(prog="batchgen", description="Offline batch LLM generation.")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _estimate_parser(sub)
    rep = sub.add_parser("report", help="latency/throughput report over one or more runs (DuckDB)")
    rep.add_argument("run_dirs", nargs="+", help="run directories (or globs, quoted)")
    rep.add_argument("--out", help="output directory (default RUN_DIR/report for one run)")
    rep.add_argument("--window-s", type=float, help="window of the tok/s-over-time table (default 1 s)")
    rep.add_argument("--memory-limit", help="DuckDB memory limit, e.g. 4GB")
    rep.add_argument("--price-per-hour", type=float, metavar="PRICE",
                     help="what the machine costs per hour (any currency): adds cost per million output tokens")
    from batchgen.benchmarks import programs

    listed = "\n".join(f"  {name:<14} {line}" for name, line in programs().items())
    bench = sub.add_parser("bench", help="engines side by side on the held prompts; `bench NAME`: any benchmark",
                           usage="batchgen bench [--engines ...] [options]\n       batchgen bench NAME [its own options]",
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           description="Without a NAME: the engines side by side on the held prompts, in one run "
                                       "(what the judge runs). With one: that benchmark, with its own options "
                                       "(batchgen bench NAME --help).",
                           epilog=f"benchmarks (batchgen bench NAME):\n{listed}")
    bench.add_argument("--engines", default="native,vllm,hf,llama.cpp,vllm-generate",
                       help="comma-separated: native, vllm (through batchgen), hf (the naive baseline), and the outside "
                            "peers llama.cpp (llama-cpp-python on the model's GGUF) and vllm-generate (vLLM's own "
                            "LLM.generate, fp32 and bf16; vllm-generate:fp32 or :bf16 runs one), each on this process's cores "
                            "(vllm-generate:fp32:default keeps vLLM's own binding, one core reserved: shown, not "
                            "judged); a peer that is not installed is left out with a line, and one "
                            "that fails is reported under the table and left out of the rest of the run")
    bench.add_argument("--native-variants", default="default,eager,compiled,onednn,auto,loose,int4,gguf",
                       help="the native engine's variants to measure (comma-separated); default is what "
                            "`batchgen generate` runs with its default flags, the row the targets judge")
    bench.add_argument("--batches", default="1,8,64,256", help="requests in flight, comma-separated")
    bench.add_argument("--modes", default="greedy,sampled", help="greedy, sampled (T 0.7, top-p 0.95)")
    bench.add_argument("--repeats", type=int, default=1,
                       help="measure each cell N times, modes alternating in order, and keep the median (its "
                            "spread is printed): a shared machine's noise, seen")
    bench.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt, EOS ignored (default 64)")
    bench.add_argument("--prompt-tokens", type=int, default=None,
                       help="every prompt this many tokens (held instructions joined and cut; e.g. 300 for the "
                            "prefill MFU target), instead of the few-shot chat prompts of real length (100 to "
                            "500 tokens: held tasks with their answers as examples, then a task)")
    bench.add_argument("--speculative", type=int, default=4, help="n-gram draft tokens for the speculation "
                                                                     "section (0: skip it)")
    bench.add_argument("--spec-batch", type=int, default=8, help="rows in flight in the speculation section (default 8)")
    bench.add_argument("--out", help="results Parquet (default runs/bench-<time>.parquet)")
    bench.add_argument("--model", default=DEFAULT_MODEL, help=f"the model (default {DEFAULT_MODEL})")
    lab = sub.add_parser("lab", help="small experiments").add_subparsers(dest="lab", required=True)
    dec = lab.add_parser("decode", help="KV cache against recomputing the history")
    dec.add_argument("--prompt-tokens", type=int, default=64)
    dec.add_argument("--new-tokens", type=int, default=32)
    dec.add_argument("--model", default=DEFAULT_MODEL)
    dec.add_argument("--device", default="cpu")
    model = sub.add_parser("model", help="model files").add_subparsers(dest="model_cmd", required=True)
    prep = model.add_parser("prepare", help="convert the shipped SmolLM2 GGUF into a local HF directory, once")
    prep.add_argument("--force", action="store_true")
    kern = sub.add_parser("kernels", help="this machine's C++ CPU kernels").add_subparsers(dest="kernels_cmd",
                                                                                           required=True)
    kb = kern.add_parser("build", help="build them now (once per machine; otherwise the first run that needs one does)")
    kb.add_argument("names", nargs="*", metavar="NAME", help="only these kernels (default: all of them; an "
                    "unknown name is refused with the list)")
    return (parser, dict(sub.choices)) if with_commands else parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) >= 2 and argv[0] == "bench" and not argv[1].startswith("-"):  # `batchgen bench NAME ...`
        from batchgen.benchmarks import run

        cap_cpu_libraries()
        try:
            return run(argv[1], argv[2:])
        except ValueError as e:
            print(f"batchgen bench: error: {e}", file=sys.stderr)
            return 2
    args = parse(argv)
    cap_cpu_libraries()  # before any matmul: oneDNN and MKL read their caps once
    handler = {"generate": cmd_generate, "estimate": cmd_estimate, "report": cmd_report, "bench": cmd_bench,
               "lab": cmd_lab, "model": cmd_prepare, "kernels": cmd_kernels}[args.command]
    try:
        return handler(args)
    except KeyboardInterrupt as e:  # SIGINT, or SIGTERM during a run (batchgen.signals.Interrupted)
        print(f"batchgen: {e or 'interrupted'}; the same command resumes the run", file=sys.stderr)
        return 130
    except BudgetReached as e:  # a planned stop, not an error: its own exit status
        print(f"batchgen: stopped: {e}", file=sys.stderr)
        return 3
    except Exception as e:  # noqa: BLE001 - one clear line for the user, not a traceback
        if os.environ.get("BATCHGEN_DEBUG"):
            raise
        from pydantic import ValidationError

        if isinstance(e, ValidationError):
            msg = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        else:
            msg = str(e)
        print(f"batchgen: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
