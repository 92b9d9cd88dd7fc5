"""What a bench run measured, and the verdict on it: one Measurement a cell, the ratios within the
run (against the best peer, agreement with fp32, speculation on and off), the printed table, the
issue's targets judged as met or missed, and the Parquet file. batchgen.benchmarks.bench runs the
engines and makes the measurements; nothing here runs a model."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path


@dataclass
class Measurement:
    section: str  # grid | speculative
    engine: str  # native, native:auto, native:int4, vllm, hf
    dtype: str
    batch: int
    mode: str
    workload: str  # held | copy | open
    speculative_k: int
    prompts: int
    tokens: int
    seconds: float
    itl_p50_s: float | None = None
    itl_p95_s: float | None = None
    itl_p99_s: float | None = None
    mbu: float | None = None  # over the whole run, prefill included
    decode_mbu: float | None = None  # over the steps that only decode (the memory-bound part)
    vs_best_peer: float | None = None  # this engine's tok/s over the best other engine's, same batch and mode
    agreement_fp32: float | None = None  # greedy tokens before the first divergence from native fp32
    acceptance_rate: float | None = None
    speedup_vs_off: float | None = None  # speculation on over off, same engine and workload
    identical_to_off: bool | None = None
    repeats: int = 1  # measurements of this cell, modes alternating in order; the median one is kept
    spread: float | None = None  # (max - min) / median tok/s over the repeats: the noise this run saw
    compile_s: float | None = None  # seconds compiling in the untimed warm-up (compiled variants)
    sample_share: float | None = None  # seconds choosing tokens (argmax / sampler) over decode-step seconds
    decode_mbu_p50: float | None = None  # decode MBU at the median decode step (median over the repeats)
    peak_read_bytes_per_s: float | None = None  # the read peak its MBU is against: median of those beside its repeats
    step_itl_p50_s: float | None = None  # the median over the repeats of each run's ITL p50 (see targets)
    decode_tok_per_s: float | None = None  # tokens of the decode-only steps over their seconds
    prefill_tok_per_s: float | None = None  # prompt tokens over the seconds of the steps that computed them
    prefill_mfu: float | None = None  # those tokens' matmul FLOPs per second over the peak in the dtype (median
    # over the repeats, each against the matmul peak measured beside it)
    peak_flops: float | None = None  # that peak: the median of those beside its repeats
    cached_prompt_tokens: int | None = None  # served by the engine's prefix cache (0: every prompt computed)
    cores: str | None = None  # the CPUs its compute threads ran on ("0-1"), or how its engine chose them
    threads: int | None = None  # its compute threads
    cpu_s: float | None = None  # CPU seconds (user + system, every process of the bench) of the median repeat
    preemptions: int | None = None  # rows preempted in its timed calls, all repeats (None: the engine does not say)
    repeat_tok_per_s: list = field(default_factory=list)  # every repeat's tok/s, in the order measured
    outputs: list = field(default_factory=list, repr=False)  # token ids per prompt (not written)

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def agreement(ref: list[list[int]], got: list[list[int]]) -> float | None:
    same = total = 0
    for a, b in zip(ref, got):
        same += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        total += len(a)
    return same / total if total else None



def compare(results: list[Measurement]) -> None:
    """Ratios measured within this run: vs the best peer, agreement with fp32, speculation on/off."""
    grid = [m for m in results if m.section == "grid"]
    for m in grid:
        peers = [p.tok_per_s for p in grid if (p.batch, p.mode) == (m.batch, m.mode)
                 and p.engine.split(":")[0] != m.engine.split(":")[0]]
        m.vs_best_peer = m.tok_per_s / max(peers) if peers else None
        # every variant and peer against native fp32: eager, or compiled where eager is not in the run
        # (the two give the same tokens, tested)
        ref = next((p for name in ("native", "native:compiled") for p in grid
                    if (p.engine, p.batch, p.mode) == (name, m.batch, "greedy")), None)
        if ref is not None and ref is not m and m.mode == "greedy" and m.outputs:
            m.agreement_fp32 = agreement(ref.outputs, m.outputs)
    for m in results:
        if m.section == "speculative" and m.speculative_k:
            off = next(p for p in results if p.section == "speculative" and p.speculative_k == 0
                       and (p.engine, p.workload) == (m.engine, m.workload))
            m.speedup_vs_off = m.tok_per_s / off.tok_per_s if off.tok_per_s else None
            m.identical_to_off = m.outputs == off.outputs


def write_parquet(results: list[Measurement], conditions: dict, path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for m in results:
        d = asdict(m)
        d.pop("outputs")
        d["tok_per_s"] = m.tok_per_s
        d["conditions"] = json.dumps(conditions, default=str)
        rows.append(d)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def read_results(path: Path) -> tuple[list[Measurement], dict]:
    """A bench run's Parquet back as its Measurements (without their tokens) and its conditions."""
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    if not rows:
        raise ValueError(f"{path}: no measurements in it")
    names = {f.name for f in fields(Measurement)} - {"outputs"}
    return [Measurement(**{k: v for k, v in r.items() if k in names}) for r in rows], json.loads(rows[0]["conditions"])


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _peak_flops(c: dict) -> str:
    peaks = c.get("peak_flops") or {}
    return ("" if not peaks else
            " and matmul " + ", ".join(f"{v / 1e9:.{0 if v >= 1e10 else 2}f} GFLOP/s in {k}"  # a crawl shows
                                       for k, v in peaks.items() if v))


def _beside(c: dict) -> str:
    peaks = c.get("peak_read_beside_repeats") or []
    flops = c.get("peak_flops_beside_repeats") or {}
    return ((f"; read peak beside each repeat {min(peaks) / 1e9:.1f}-{max(peaks) / 1e9:.1f} GB/s (the MBU columns are "
             f"against the one beside their repeat)" if peaks else "")
            + "".join(f"; {d} matmul peak beside each repeat {min(v) / 1e9:,.0f}-{max(v) / 1e9:,.0f} GFLOP/s (pre MFU "
                      f"is against it)" for d, v in flops.items() if v))


def format_bench(results: list[Measurement], conditions: dict) -> str:
    c = conditions
    reps = c.get("repeats", 1)
    how = "one run" if reps == 1 else f"one run, each cell measured {reps} times (modes alternating), the median shown"
    lines = [f"batchgen bench, {how}, {c['date']}: model {Path(c['model']).name}, {c['new_tokens']} new tokens per "
             f"prompt, {c.get('prompts', 'the held chat prompts')}, {c['cpu']} ({c.get('cpu_features', '?')}; {c['cores']} cores, torch threads {c['torch_threads']}), peak read "
             f"{(c['peak_read_bytes_per_s'] or 0) / 1e9:.1f} GB/s{_peak_flops(c)} measured at the start of this run (the cached "
             f"probe: {(c.get('cached_probe_read_bytes_per_s') or 0) / 1e9:.1f}){_beside(c)}; {c['packages']}"
             + (f"; {c['llama_cpp_build']}" if c.get("llama_cpp_build") else ""),
             "", f"{'engine':<18} {'dtype':<9} {'batch':>5} {'mode':<8} {'tok/s':>8} {'dec tok/s':>9} {'pre tok/s':>9} "
                 f"{'pre MFU':>7} "
                 f"{'vs best peer':>12} "
                 f"{'ITL p50 ms':>10} {'p95':>7} {'p99':>7} {'MBU':>5} {'dec MBU':>7} {'agree fp32':>10} {'compile s':>9} "
                 f"{'pick %':>6} {'cores':>6} {'thr':>3} {'CPU s':>7} {'preempt':>7}"
                 + (f" {'spread':>6} {'repeats tok/s (in order)'}" if reps > 1 else "")]
    for m in (r for r in results if r.section == "grid"):
        ms = lambda v: _fmt(None if v is None else 1000 * v, ".1f")  # noqa: E731
        lines.append(f"{m.engine:<18} {m.dtype:<9} {m.batch:>5} {m.mode:<8} {m.tok_per_s:>8.1f} "
                     f"{_fmt(m.decode_tok_per_s, '.1f'):>9} {_fmt(m.prefill_tok_per_s, '.0f'):>9} "
                     f"{_fmt(m.prefill_mfu, '.2f'):>7} "
                     f"{_fmt(m.vs_best_peer, '.2f') + ('x' if m.vs_best_peer else ''):>12} {ms(m.itl_p50_s):>10} {ms(m.itl_p95_s):>7} "
                     f"{ms(m.itl_p99_s):>7} {_fmt(m.mbu, '.2f'):>5} {_fmt(m.decode_mbu, '.2f'):>7} "
                     f"{_fmt(m.agreement_fp32, '.2f'):>10} {_fmt(m.compile_s, '.1f'):>9} "
                     f"{_fmt(None if m.sample_share is None else 100 * m.sample_share, '.1f'):>6} "
                     f"{(m.cores or '-') if len(m.cores or '') <= 6 else 'vLLM':>6} {_fmt(m.threads, 'd'):>3} "
                     f"{_fmt(m.cpu_s, '.1f'):>7} {_fmt(m.preemptions, 'd') + ('!' if m.preemptions else ''):>7}"
                     + (f" {_fmt(None if m.spread is None else 100 * m.spread, '.0f') + '%':>6} "
                        + " ".join(f"{r:.1f}" for r in m.repeat_tok_per_s) if reps > 1 else ""))
    spec = [r for r in results if r.section == "speculative"]
    if spec:
        lines += ["", f"speculative decoding (n-gram), greedy, batch {spec[0].batch}: "
                      "'copy' repeats its prompt, 'open' is the held instructions",
                  f"{'engine':<8} {'workload':<8} {'k':>2} {'tok/s':>8} {'acceptance':>10} {'speed-up':>9} {'same output':>11}"]
        for m in spec:
            lines.append(f"{m.engine:<8} {m.workload:<8} {m.speculative_k:>2} {m.tok_per_s:>8.1f} "
                         f"{_fmt(m.acceptance_rate, '.2f'):>10} {_fmt(m.speedup_vs_off, '.2f') + ('x' if m.speedup_vs_off else ''):>9} "
                         f"{_fmt(m.identical_to_off, ''):>11}")
    if c.get("peers_failed"):  # outside peers that died: the cells they had measured stay, with their repeats
        lines += ["", "peers that failed in this run, left out from then on (the cells above are those measured "
                      "before; their repeats are in the Parquet):",
                  *(f"  {name}, {why}" for name, why in c["peers_failed"].items())]
    if any(m.cores and len(m.cores) > 6 for m in results):
        lines.append("cores 'vLLM': vLLM's own binding (one core reserved for its scheduler); '!': the cell preempted "
                     "rows inside its timed calls")
    if c.get("protocol"):
        lines += ["", f"protocol: {c['protocol']}"]
    lines += ["", *targets(results, conditions)]
    return "\n".join(lines)


@dataclass(frozen=True)
class Verdict:
    """One of the issue's targets, judged on one run's figures: `score` (a ratio against a peer in the
    same run, or a share of the machine's measured peak) against `goal`. `native` and `peer` are the
    figures behind it, as a table cell shows them; `line` is the sentence the bench prints."""
    workload: str  # what was measured: "batch 64, bfloat16", "batch 1, decode steps, native:auto (float32)"
    native: str  # the judged engine's figure: "429.2 tok/s (native:auto)"
    peer: str  # what it is held against: "vLLM `generate` 224.5", "the probe's bfloat16 matmul peak, 1,474 GFLOP/s"
    score: float
    goal: float
    kind: str  # "x": a ratio against the peer; "MFU" or "MBU": a share of the peak
    line: str
    cells: tuple = field(default=(), compare=False, repr=False)  # the measurements behind it: judged, then peer

    @property
    def equal_work(self) -> bool:
        """False where a cell behind it was served its prompts from a prefix cache (beyond its rows'
        template heads): its ratio compares unequal work, and is not judged."""
        return all((m.cached_prompt_tokens or 0) <= 32 * m.prompts for m in self.cells)

    @property
    def repeats(self) -> int | None:
        """The repeats behind the verdict: the fewest of its cells' (a peer that died has fewer)."""
        return min((m.repeats for m in self.cells), default=None)

    @property
    def repeat_range(self) -> tuple[float, float] | None:
        """A ratio's lowest and highest over the repeats, pairing each repeat of the judged cell with the
        same repeat of its peer (the engines took turns within a repeat); None where they cannot pair."""
        if self.kind != "x" or len(self.cells) != 2:
            return None
        a, b = (m.repeat_tok_per_s for m in self.cells)
        if not a or len(a) != len(b) or not all(b):
            return None
        ratios = [x / y for x, y in zip(a, b)]
        return min(ratios), max(ratios)

    @property
    def met(self) -> bool:
        return self.score >= self.goal

    @property
    def verdict(self) -> str:
        return _mark(self.score, self.goal)


def _on(m: Measurement) -> str:
    """Where a cell's engine computed, and the CPU seconds its median repeat took, as a table cell says
    it: ", cores 0-1, 2 threads, 67 CPU s"; older runs recorded none."""
    served = (f", {m.cached_prompt_tokens:,} prompt tokens served from its prefix cache"
              if (m.cached_prompt_tokens or 0) > 32 * m.prompts else "")  # more than the rows' template heads
    if m.cores is None:
        return served
    return (f", cores {m.cores}" + (f", {m.threads} threads" if m.threads else "")
            + (f", {m.cpu_s:.0f} CPU s" if m.cpu_s else "") + served)


def _mark(score: float, goal: float) -> str:
    return "met" if score >= goal else "MISSED"


def _cell(results: list[Measurement], engine: str, batch: int, mode: str) -> Measurement | None:
    return next((m for m in results if m.section == "grid" and (m.engine, m.batch, m.mode) == (engine, batch, mode)),
                None)


def _ratio(workload: str, native: str, peer: str, score: float, goal: float, line: str, cells: tuple = ()) -> Verdict:
    v = Verdict(workload, native, peer, score, goal, "x", f"{line}: {score:.2f}x (target {goal}x) {_mark(score, goal)}",
                cells)
    low_high = v.repeat_range
    return replace(v, line=v.line + (f" (repeats {low_high[0]:.2f}-{low_high[1]:.2f}x)" if low_high else ""))


def verdicts(results: list[Measurement], conditions: dict | None = None) -> list[Verdict]:
    """The issue's targets for this machine, judged on this run's figures (those it measured: a run
    of some engines and batches judges the targets they make). The native figure against a peer is the
    best native row in the peer's dtype."""
    c = conditions or {}

    def get(engine, batch, mode):
        return _cell(results, engine, batch, mode)

    def fp32(batch, mode):
        got = [m for m in (get("native", batch, mode), get("native:compiled", batch, mode)) if m]
        return max(got, key=lambda m: m.tok_per_s) if got else None

    def tok(m: Measurement, rate: float | None = None) -> str:
        return f"{m.tok_per_s if rate is None else rate:.1f} tok/s ({m.engine}{_on(m)})"

    def vllm(m: Measurement, rate: float | None = None) -> str:
        return f"vLLM `generate` {m.tok_per_s if rate is None else rate:.1f}{_on(m)}"

    out: list[Verdict] = []
    grid = [m for m in results if m.section == "grid"]
    for b in (64, 256):  # against vLLM's own generate on the same cores, in its dtype, prefill included
        for dtype, tag in (("float32", "fp32"), ("bfloat16", "bf16")):
            peer = get(f"vllm-generate:{tag}", b, "greedy")
            if not peer:
                continue
            # the row judged: what `batchgen generate` runs with default flags; where its dtype is not
            # the peer's, the best native row in the peer's dtype (its flags differ: said in the row)
            default = get("native:default", b, "greedy")
            mine = [m for m in grid if m.engine.startswith("native") and m.dtype == dtype and m.batch == b
                    and m.mode == "greedy" and m.engine != "native:gguf"]
            auto = default or get("native:auto", b, "greedy")
            judged = default if default and default.dtype == dtype else (
                max(mine, key=lambda m: m.tok_per_s) if mine else None)
            if judged:
                flags = "" if judged is default else f" (not the default: --dtype {dtype})"
                out.append(_ratio(f"batch {b}, {dtype}{flags}", tok(judged), vllm(peer),
                                  judged.tok_per_s / peer.tok_per_s, 1.2,
                                  f"  batch {b} {dtype} greedy, {judged.engine}{flags} / vLLM's generate",
                                  (judged, peer)))
            elif auto:  # e.g. bf16 on an AVX2 CPU, which has no bf16 math: auto takes float32
                out.append(_ratio(f"batch {b}, vLLM in {dtype}, {auto.engine} in {auto.dtype}", tok(auto),
                                  vllm(peer), auto.tok_per_s / peer.tok_per_s, 1.2,
                                  f"  batch {b} {dtype} greedy: no native row in {dtype} (--dtype auto takes "
                                  f"{auto.dtype} on this CPU); {auto.engine} / vLLM's generate in {dtype}",
                                  (auto, peer)))
    for m in grid:  # vLLM through batchgen against vLLM's own generate, same dtype and workload
        peer = get(f"vllm-generate:{'bf16' if m.dtype == 'bfloat16' else 'fp32'}", m.batch, m.mode)
        if m.engine == "vllm" and peer:
            out.append(_ratio(f"batch {m.batch}, {m.dtype}, `--engine vllm` through batchgen", tok(m),
                              vllm(peer), m.tok_per_s / peer.tok_per_s, 0.95,
                              f"  batch {m.batch} {m.dtype} {m.mode}, batchgen --engine vllm / vLLM's generate",
                              (m, peer)))
    for b in sorted({m.batch for m in grid}):  # what batch invariance (the default) costs: at most 10%
        inv, loose = get("native:auto", b, "greedy"), get("native:loose", b, "greedy")
        if inv and loose:
            out.append(_ratio(f"batch {b}, batch-invariant `auto` ({inv.dtype})", tok(inv),
                              f"`auto` with `--batch-invariant off` {loose.tok_per_s:.1f}",
                              inv.tok_per_s / loose.tok_per_s, 0.9,
                              f"  batch {b} greedy, batch-invariant auto ({inv.dtype}) / auto with --batch-invariant "
                              f"off ({loose.dtype})"))
    llama = get("llama.cpp", 1, "greedy")
    if llama and llama.decode_tok_per_s:  # batch 1, decode steps only
        for engine in ("native:default", "native:auto", "native:gguf"):
            m = get(engine, 1, "greedy")
            if m and m.decode_tok_per_s:
                v = _ratio(f"batch 1, decode steps, {engine} ({m.dtype})", tok(m, m.decode_tok_per_s),
                           f"llama.cpp Q4_1 {llama.decode_tok_per_s:.1f}", m.decode_tok_per_s / llama.decode_tok_per_s,
                           1.0, f"  batch 1 decode, {engine} ({m.dtype}) / llama.cpp Q4_1",
                           (m,))  # decode rates: no per-repeat pairs of them are kept, so no range
                out.append(replace(v, line=f"{v.line}; with prefill {m.tok_per_s / llama.tok_per_s:.2f}x"))
    for b in (64,):  # prefill in the chosen dtype against the matmul peak measured beside its repeats (the
        # one denominator of PROTOCOL: a run without it is not judged on MFU)
        m = next((x for x in (get("native:default", b, "greedy"), get("native:auto", b, "greedy"))
                  if x and x.prefill_mfu is not None and x.peak_flops), None)
        if m and c.get("prompt_length"):  # the target's prompts of a set length
            prompts = c.get("prompts", "held")
            out.append(Verdict(
                f"batch {b} prefill, {m.dtype}, {prompts}",
                f"{m.prefill_tok_per_s:,.0f} prompt tok/s ({m.engine}{_on(m)})",
                f"the {m.dtype} matmul peak beside its repeats, {m.peak_flops / 1e9:,.0f} GFLOP/s",
                m.prefill_mfu, 0.6, "MFU",
                f"  batch {b} prefill MFU, {m.engine} ({m.dtype}): {m.prefill_mfu:.2f} of the peak matmul FLOP/s "
                f"(target 0.60 on 64 prompts of 300 tokens; these: {prompts}) "
                f"{_mark(m.prefill_mfu, 0.6)}", cells=(m,)))
    # judged at the median step, with the mean beside it: these runs share a noisy machine, and a slow
    # patch of a few seconds moves a run's total time (and so its tok/s) by more than a 5% target
    # (the default, on the bytes its weights take: the GGUF blocks where auto takes them; and fp32's)
    for what, one in (("default", get("native:default", 1, "greedy") or get("native:auto", 1, "greedy")),
                      ("fp32", fp32(1, "greedy"))):
        if one and one.decode_mbu_p50 is not None:
            bw = one.peak_read_bytes_per_s
            where = "beside its repeats" if c.get("peak_read_beside_repeats") else "at the run's start"  # older runs
            peak = "" if bw is None else f" of a {bw / 1e9:.1f} GB/s read peak (measured {where})"
            out.append(Verdict(
                f"batch 1, decode MBU at the median step, {what}", tok(one, one.decode_tok_per_s),
                f"the read peak {where}" + ("" if bw is None else f", {bw / 1e9:.1f} GB/s"),
                one.decode_mbu_p50, 0.6,
                "MBU", f"  batch 1 decode MBU at the median step, {what} ({one.engine}, {one.dtype}): "
                       f"{one.decode_mbu_p50:.2f}{peak} (target 0.60) "
                       f"{_mark(one.decode_mbu_p50, 0.6)}; over all decode steps "
                       f"{_fmt(one.decode_mbu, '.2f')}, whole run with prefill {_fmt(one.mbu, '.2f')}", cells=(one,)))
    for engine in ("native", "native:compiled"):
        for b in sorted({m.batch for m in grid}):
            g, s = get(engine, b, "greedy"), get(engine, b, "sampled")
            if not (g and s and g.step_itl_p50_s and s.step_itl_p50_s):
                continue
            r = g.step_itl_p50_s / s.step_itl_p50_s
            share = (f"; choosing tokens took {100 * s.sample_share:.1f}% of the decode steps sampled, "
                     f"{100 * g.sample_share:.1f}% greedy" if s.sample_share is not None and g.sample_share is not None
                     else "")
            out.append(Verdict(
                f"batch {b}, sampled against greedy, {engine} (float32), median decode step",
                f"{1000 * s.step_itl_p50_s:.1f} ms a step sampled", f"greedy {1000 * g.step_itl_p50_s:.1f} ms", r, 0.95,
                "x", f"  batch {b} sampled / greedy ({engine} fp32), median decode step: {r:.2f} (target 0.95) "
                     f"{_mark(r, 0.95)}; whole runs (tok/s) {s.tok_per_s / g.tok_per_s:.2f}{share}"))
    return out


def targets(results: list[Measurement], conditions: dict | None = None) -> list[str]:
    """The issue's targets as the bench prints them (verdicts' lines), then what `--fp32-kernel auto`
    chose beside the two fp32 kernels measured (a comparison, not a target)."""
    out = ["targets (this run):", *(v.line if v.equal_work else f"{v.line}; NOT JUDGED: its prompts were served from a "
                                    f"prefix cache, not computed" for v in verdicts(results, conditions))]
    for b in sorted({m.batch for m in results if m.section == "grid"}):  # the fp32 kernels, side by side
        g, o = _cell(results, "native:compiled", b, "greedy"), _cell(results, "native:onednn", b, "greedy")
        if g and o and g.step_itl_p50_s and o.step_itl_p50_s:
            auto = (conditions or {}).get("fp32_kernel_auto", {}).get(str(b), "?")
            out.append(f"  batch {b} fp32 greedy, gemv kernel / oneDNN's (compiled), median decode step: "
                       f"{o.step_itl_p50_s / g.step_itl_p50_s:.2f}x; whole runs (tok/s) {g.tok_per_s / o.tok_per_s:.2f}x; "
                       f"--fp32-kernel auto takes {auto} at this batch")
    return out
