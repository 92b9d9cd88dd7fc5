"""Prefect flow: generate then report, as one deployable pipeline."""

from __future__ import annotations

from typing import Any

from prefect import flow

from batchgen.settings import GenerateSettings
from flows.generate import FanOut, generate
from flows.report import report


@flow(name="batchgen-pipeline")
def pipeline(settings: GenerateSettings, fanout: FanOut = FanOut()) -> dict[str, Any]:
    """Generate a dataset, then publish its latency and throughput report.

    Args:
        settings: the generation job: input, model, engine, sampling, batching and output
        fanout: where the shard tasks run: in this process, or on a Ray cluster
    """
    run = generate(settings, fanout)
    # the report runs inside this flow run (not as a subflow), so its artifacts land on the run a user
    # started from the form, where the UI's Artifacts tab shows them
    rep = report.fn([run["run_dir"]])
    return {**run, "report": rep["out_dir"]}


def main(argv: list[str] | None = None) -> None:
    """`python -m flows.pipeline --config configs/cpu-demo.yaml`: the pipeline on a local Prefect."""
    import argparse

    from batchgen.report.build import HEADLINE_QUERIES, headline_text
    from batchgen.report.queries import connect, run_query
    ap = argparse.ArgumentParser(prog="python -m flows.pipeline", description=main.__doc__, allow_abbrev=False)
    ap.add_argument("--config", required=True, help="a YAML run config, e.g. configs/cpu-demo.yaml (its keys are "
                                                     "`batchgen generate`'s flags with '_')")
    ap.add_argument("--run-id", help="resume this run, or name a new one (default: a new id)")
    ap.add_argument("--ray-address", help="shard tasks on this Ray cluster ('auto', 'ray://head:10001')")
    ap.add_argument("--gpus-per-shard", type=float, default=0.0, help="GPUs Ray gives each shard task")
    args = ap.parse_args(argv)
    values = {"config": args.config}
    if args.run_id:
        values["run_id"] = args.run_id
    result = pipeline(GenerateSettings(**values), FanOut(ray_address=args.ray_address, gpus_per_shard=args.gpus_per_shard))
    con = connect([result["run_dir"]])
    print(headline_text({q: run_query(con, q) for q in HEADLINE_QUERIES}))
    print(f"\nrun: {result['run_dir']} ({result['rows']} rows: {result['ok']} outputs, {result['errors']} errors)")
    print(f"report: {result['report']}/report.html")


if __name__ == "__main__":
    main()
