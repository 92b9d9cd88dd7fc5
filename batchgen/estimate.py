"""`batchgen estimate`: what a `generate` command will do and cost, before it runs.

It takes generate's own settings and goes through the input as the run would (the same reader, the
same chat template and tokenizer, the same row errors), so its row and prompt-token counts are
exact. Rows an earlier run already answered under the same request key (`--reuse-from`) are counted
apart: the run copies them. Output tokens are bounded by each row's max_tokens; earlier runs given
with `--history` say how many a row really makes (their mean, never above a row's max_tokens).

Time comes from rates: prompt tokens per second in the steps that prefill, output tokens per second
in the steps that only decode. They are measured by a short probe at the run's own settings (the
engine the run would load, one batch of the input's own first rows, `--probe-tokens` tokens each),
or read from the steps of the `--history` runs. Expected seconds = prompt tokens / prefill rate +
output tokens / decode rate, plus the engine's load time; cost = hours x `--price-per-hour`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from batchgen.config import RunConfig, SamplingParams
from batchgen.engine.base import Engine, StepResult


@dataclass
class Estimate:
    rows: int = 0  # input rows
    error_rows: int = 0  # rows that would become errors before the engine (validation, too long)
    requests: int = 0  # requests the rest make (n samples a row)
    reusable: int = 0  # of those, answered by a --reuse-from run under the same key: copied, not generated
    prompt_tokens: int = 0  # of the requests to generate
    max_output_tokens: int = 0  # their max_tokens, each capped by the context left
    output_tokens: int = 0  # expected: max_output_tokens, or the --history runs' mean a row
    output_basis: str = "max_tokens"
    prefill_tok_per_s: float = 0.0
    decode_tok_per_s: float = 0.0
    rate_basis: str = ""
    load_s: float = 0.0  # the engine's load and first compile, which the run pays too
    seconds: float = 0.0
    price_per_hour: float | None = None
    cost: float | None = None
    conditions: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "hours": self.seconds / 3600}

    def format(self) -> str:
        lines = [f"rows: {self.rows} ({self.error_rows} would be errors before generation); requests: "
                 f"{self.requests}, {self.reusable} of them reusable from --reuse-from (copied, not generated)",
                 f"prompt tokens to compute: {self.prompt_tokens} (exact: tokenized as the run would)",
                 f"output tokens: {self.output_tokens} expected ({self.output_basis}); at most "
                 f"{self.max_output_tokens}",
                 f"rates: prefill {self.prefill_tok_per_s:.1f} prompt tok/s, decode {self.decode_tok_per_s:.1f} "
                 f"output tok/s ({self.rate_basis})",
                 f"time: {_hms(self.seconds)} ({self.seconds / 3600:.2f} h, with {self.load_s:.0f} s to load the model "
                 f"and compile)"]
        if self.cost is not None:
            lines.append(f"cost: {self.cost:.2f} at {self.price_per_hour:g} an hour")
        return "\n".join(lines)


def _hms(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"


def rates_of_steps(steps) -> tuple[float, float]:
    """(prompt tok/s over the steps that prefill, output tok/s over the steps that only decode), from
    (start_t, end_t, num_prefill_tokens, num_decode_tokens) a step."""
    pre_t = pre_n = dec_t = dec_n = 0.0
    for start_t, end_t, prefill, decode in steps:
        if prefill:
            pre_t, pre_n = pre_t + end_t - start_t, pre_n + prefill
        elif decode:
            dec_t, dec_n = dec_t + end_t - start_t, dec_n + decode
    return (pre_n / pre_t if pre_t else 0.0), (dec_n / dec_t if dec_t else 0.0)


def _run(engine: Engine, rows: list, tokens: int, tag: str) -> list[StepResult]:
    steps: list[StepResult] = []
    for i, p in enumerate(rows):
        engine.add(f"{tag}-{i}", p.prompt_token_ids,
                   SamplingParams(max_tokens=max(2, min(tokens, p.sampling.max_tokens)), ignore_eos=True))
    while engine.has_unfinished():
        steps.append(engine.step())
    return steps


def probe(engine: Engine, rows: list, tokens: int) -> tuple[float, float, float, str]:
    """Run `rows` (PreparedRow samples, one batch) for up to `tokens` tokens each, EOS ignored so each
    decodes as long as asked, after a short pass that compiles what the run compiles once (its time,
    less its prefill at the measured rate, is start-up the run pays too); (prefill rate, decode rate,
    start-up seconds, what was measured)."""
    t0 = time.perf_counter()
    _run(engine, rows, 2, "warm")
    warm = time.perf_counter() - t0
    if hasattr(engine, "reset_prefix_cache"):
        engine.reset_prefix_cache()  # the measured pass computes its prompts, as the run does once
    pre, dec = rates_of_steps((s.start_t, s.end_t, s.num_prefill_tokens, s.num_decode_tokens)
                              for s in _run(engine, rows, tokens, "probe"))
    startup = max(0.0, warm - sum(len(p.prompt_token_ids) for p in rows) / pre) if pre else warm
    return pre, dec, startup, (f"a probe of {len(rows)} of the input's rows at once, {tokens} tokens each, at the "
                               f"run's settings")


def history(runs: list[str]) -> dict[str, float]:
    """From earlier runs: output tokens a generated row made (mean), and their step rates."""
    from batchgen.report.queries import connect

    con = connect(runs)
    ((mean_out, n),) = con.sql("select avg(output_tokens), count(*) from generated").fetchall()
    pre, dec = rates_of_steps(con.sql("select start_t, end_t, num_prefill_tokens, num_decode_tokens from steps").fetchall())
    return {"mean_output_tokens": mean_out or 0.0, "rows": n, "prefill_tok_per_s": pre, "decode_tok_per_s": dec}


def estimate(cfg: RunConfig, history_runs: tuple[str, ...] = (), probe_tokens: int = 32, use_probe: bool = True,
             probe_rows: int = 64, create=None) -> Estimate:
    """The estimate of `cfg`'s run (see the module's docstring). `probe_rows`: the probe's batch (at
    most max_num_seqs); `create`: how the engine is made (batchgen.engine.create_engine)."""
    from batchgen.data.prompts import InputProcessor, RowError
    from batchgen.data.reader import PromptDataset
    from batchgen.data.reuse import ReuseIndex, numerics, request_key
    from batchgen.engine import create_engine
    from batchgen.metrics.conditions import model_fingerprint
    from batchgen.model.prepare import resolve_model

    if not use_probe and not history_runs:
        raise ValueError("no rates to estimate from: keep the probe, or give --history runs")
    dataset = PromptDataset(cfg.inputs, cfg.keep_columns)
    model_dir = resolve_model(cfg.model)
    t0 = time.perf_counter()
    engine = (create or create_engine)(cfg.engine, model_dir, cfg.engine_config, options=dict(cfg.engine_options),
                                       lora_adapters=dict(cfg.lora_adapters))
    est = Estimate(load_s=time.perf_counter() - t0, price_per_hour=cfg.price_per_hour, conditions=engine.conditions())
    try:
        processor = InputProcessor.for_run(cfg, engine.tokenizer, engine.max_model_len)
        numerics_ = numerics(model_fingerprint(model_dir), est.conditions, engine.max_model_len)
        reuse = ReuseIndex(list(cfg.reuse_from)) if cfg.reuse_from and numerics_ else None
        past = history(list(history_runs)) if history_runs else None
        batch = min(cfg.engine_config.max_num_seqs, probe_rows)
        sample: list = []
        try:
            for shard in dataset.shards(cfg.shard_size):
                todo = []
                for row in shard.rows():
                    est.rows += 1
                    p = processor.process(row)
                    if isinstance(p, RowError):
                        est.error_rows += 1
                        continue
                    for k, s in enumerate(p.samples()):
                        key = request_key(numerics_, s.prompt_token_ids, s.sampling, k) if reuse else None
                        todo.append((s, key))
                found = reuse.lookup([k for _, k in todo if k is not None]) if reuse else {}
                for s, key in todo:
                    est.requests += 1
                    if key in found and s.sampling.logprobs is None:
                        est.reusable += 1
                        continue
                    room = engine.max_model_len - len(s.prompt_token_ids)
                    most = min(s.sampling.max_tokens, room)
                    est.prompt_tokens += len(s.prompt_token_ids)
                    est.max_output_tokens += most
                    est.output_tokens += min(most, round(past["mean_output_tokens"])) if past else most
                    if len(sample) < batch:
                        sample.append(s)
        finally:
            if reuse is not None:
                reuse.close()
        if past:
            est.output_basis = (f"the --history runs' mean of {past['mean_output_tokens']:.1f} tokens a row over "
                                f"{past['rows']} rows, capped by each row's max_tokens")
        if use_probe and sample:
            est.prefill_tok_per_s, est.decode_tok_per_s, startup, est.rate_basis = probe(engine, sample, probe_tokens)
            est.load_s += startup
        elif past:
            est.prefill_tok_per_s, est.decode_tok_per_s = past["prefill_tok_per_s"], past["decode_tok_per_s"]
            est.rate_basis = "the --history runs' steps"
    finally:
        engine.close()
    work = 0.0
    if est.prompt_tokens:
        work += est.prompt_tokens / est.prefill_tok_per_s if est.prefill_tok_per_s else float("inf")
    if est.output_tokens:
        work += est.output_tokens / est.decode_tok_per_s if est.decode_tok_per_s else float("inf")
    est.seconds = est.load_s + work
    if cfg.price_per_hour is not None:
        est.cost = est.seconds / 3600 * cfg.price_per_hour
    return est
