"""`python -m batchgen.benchmarks.estimate`: `batchgen estimate` against the run it estimates.

For each prompt mix and batch size, in one process one after another: the estimate (its probe at the
run's settings), then the real `generate` run with the same settings, then both side by side: rows,
prompt tokens, output tokens and seconds. The time is also estimated again from the run's actual
output tokens, which tells the rates' error from the output-length guess's (`max_tokens` is an upper
bound where rows end by EOS).

Mixes: `questions`, the seed tasks as plain questions (short prompts, chat template added, answers
end by EOS); `few-shot`, the bench's chat prompts of 100-400 tokens (held tasks as worked examples,
rendered already), `--max-tokens` each with EOS ignored, so the output count is known.

    python -m batchgen.benchmarks.estimate --batches 8,32 --rows 48 --max-tokens 64
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

MIXES = ("questions", "few-shot")


def write_mix(mix: str, rows: int, path: Path, tokenizer) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if mix == "questions":
        from batchgen.benchmarks.bench import held_tasks

        prompts = [t for t, _ in held_tasks()][:rows]
    else:
        from batchgen.benchmarks.bench import held_prompt_ids

        prompts = [tokenizer.decode(ids, keep_special=True) for ids in held_prompt_ids(tokenizer, rows)]
    pq.write_table(pa.table({"id": [f"{mix}-{i}" for i in range(len(prompts))], "prompt": prompts}), path)
    return path


def one(mix: str, batch: int, rows: int, max_tokens: int, model: str, root: Path) -> dict:
    from batchgen.config import EngineConfig, RunConfig, SamplingParams
    from batchgen.estimate import estimate
    from batchgen.model.prepare import resolve_model
    from batchgen.model.tokenizer import Tokenizer
    from batchgen.report.queries import connect
    from batchgen.runner import generate

    inp = write_mix(mix, rows, root / f"{mix}.parquet", Tokenizer(resolve_model(model)))
    cfg = RunConfig(inputs=(str(inp),), output_dir=str(root), run_id=f"{mix}-{batch}", model=model, progress=False,
                    sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=mix == "few-shot"),
                    engine_config=EngineConfig(max_num_seqs=batch))
    est = estimate(cfg, probe_rows=batch)
    t0 = time.perf_counter()
    summary = generate(cfg, probe=False)
    actual_s = time.perf_counter() - t0
    ((prompt_tokens,),) = connect([summary.run_dir]).sql("select sum(prompt_tokens) from generated").fetchall()
    again = est.load_s + est.prompt_tokens / est.prefill_tok_per_s + summary.output_tokens / est.decode_tok_per_s
    return {"mix": mix, "batch": batch, "rows": summary.rows, "est_rows": est.rows, "prompt_tokens": prompt_tokens,
            "est_prompt_tokens": est.prompt_tokens, "output_tokens": summary.output_tokens,
            "est_output_tokens": est.output_tokens, "actual_s": actual_s, "est_s": est.seconds, "est_s_again": again,
            "load_s": est.load_s, "prefill_tok_per_s": est.prefill_tok_per_s, "decode_tok_per_s": est.decode_tok_per_s}


def format_rows(rows: list[dict]) -> str:
    head = ("| mix | batch | rows | prompt tokens (est / actual) | output tokens (est / actual) | seconds: est | "
            "est from actual outputs | actual | est / actual |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| {r['mix']} | {r['batch']} | {r['rows']} | {r['est_prompt_tokens']} / {r['prompt_tokens']} | "
                     f"{r['est_output_tokens']} / {r['output_tokens']} | {r['est_s']:.1f} | {r['est_s_again']:.1f} | "
                     f"{r['actual_s']:.1f} | {r['est_s'] / r['actual_s']:.2f}x (from actual outputs "
                     f"{r['est_s_again'] / r['actual_s']:.2f}x) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from batchgen.config import DEFAULT_MODEL, cap_cpu_libraries
    from batchgen.metrics.conditions import cpu_features, cpu_model

    cap_cpu_libraries()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="8,32", help="--max-num-seqs values, comma-separated")
    p.add_argument("--mixes", default=",".join(MIXES), help=f"prompt mixes: {', '.join(MIXES)}")
    p.add_argument("--rows", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model", default=DEFAULT_MODEL)
    a = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="batchgen-estimate-") as d:
        for mix in a.mixes.split(","):
            for batch in (int(b) for b in a.batches.split(",")):
                rows.append(one(mix, batch, a.rows, a.max_tokens, a.model, Path(d)))
                print(f"  {mix} at batch {batch} done", flush=True)
    import torch

    print(f"estimate against actual, {time.strftime('%Y-%m-%d %H:%M')}: {cpu_model()} ({cpu_features()}), "
          f"{torch.get_num_threads()} torch threads; {a.model}, native engine, default flags but --max-num-seqs; "
          f"{a.rows} rows a mix, --max-tokens {a.max_tokens}; each run once, its estimate just before it")
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
