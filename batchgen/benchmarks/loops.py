"""`python -m batchgen.benchmarks.loops RUN_DIR ...`: how many of a finished run's rows were caught in a
loop, and what `--repetition-stop on` would have saved on them.

Each committed row's output tokens go through the same rule the engines apply
(batchgen.engine.repetition.looping) as if the row were generated token by token; where it fires
before the row's end, the tokens after that point are what the stop saves. A greedy row stopped early
has exactly the tokens it had up to then, so on a run made with `--repetition-stop off` this is what
the same run with the stop on would give. Rows that ended by EOS or a stop string and still fire are
counted apart: they are where the rule would cut a row that was not stuck.

    batchgen generate --input tests/data/alpaca_seed_prompts.parquet --max-tokens 512 \\
        --repetition-stop off --run-id loops
    python -m batchgen.benchmarks.loops runs/loops
"""

from __future__ import annotations

import argparse


def first_loop(tokens: list[int]) -> int | None:
    """The number of tokens a row would have when the rule first fires, or None."""
    from batchgen.engine.repetition import looping

    for n in range(1, len(tokens) + 1):
        if looping(tokens[:n]):
            return n
    return None


def study(run_dirs: list[str]) -> dict:
    from batchgen.report.queries import connect

    con = connect(run_dirs)
    rows = con.sql("select id, output_token_ids, finish_reason from requests where reused_from_run is null").fetchall()
    found = {"rows": len(rows), "tokens": 0, "looping": 0, "looping_at_length": 0, "looping_ended_by_itself": 0,
             "tokens_saved": 0, "examples": []}
    for rid, toks, reason in rows:
        toks = list(toks or [])
        found["tokens"] += len(toks)
        at = first_loop(toks)
        if at is None:
            continue
        found["looping"] += 1
        found["tokens_saved"] += len(toks) - at
        if reason == "length":
            found["looping_at_length"] += 1
        else:
            found["looping_ended_by_itself"] += 1
        if len(found["examples"]) < 5:
            found["examples"].append((rid, reason, len(toks), at))
    return found


def format_study(f: dict) -> str:
    share = f["tokens_saved"] / max(f["tokens"], 1)
    lines = [f"{f['rows']} rows, {f['tokens']} output tokens; the repetition rule fires on {f['looping']} rows "
             f"({f['looping_at_length']} ran to max_tokens, {f['looping_ended_by_itself']} ended by EOS or a stop "
             f"string); stopping them saves {f['tokens_saved']} tokens, {share:.1%} of the run's output tokens"]
    lines += [f"  {rid}: {reason} after {n} tokens, looping from token {at}" for rid, reason, n, at in f["examples"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run directories (made with --repetition-stop off)")
    print(format_study(study(p.parse_args(argv).runs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
