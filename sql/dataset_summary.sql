-- What was generated, per run: a dataset builder's first questions. Outputs by how they were made
-- (generated here, reused from an earlier run, errors), how they ended (stop: EOS or a stop string;
-- length: max_tokens or the context; repetition: stopped in a loop, keeping the tokens it had made), how
-- long they are, how many repeat another row's text exactly, and for a thinking model the reasoning
-- against the answer (rows whose thought its budget closed; rows cut by max_tokens before answering).
-- Reused rows are the run's dataset too, so they count here (never in latency/throughput).
with per_run as (
    select
        run_id,
        count(*) as outputs,
        count(*) filter (where reused_from_run is not null) as reused,
        count(*) filter (where finish_reason = 'stop') as finished_stop,
        count(*) filter (where finish_reason = 'length') as finished_length,
        count(*) filter (where finish_reason = 'repetition') as finished_repetition,
        count(*) filter (where reasoning is not null) as with_reasoning,
        avg(reasoning_tokens) filter (where reasoning is not null) as reasoning_tokens_mean,
        avg(output_tokens - reasoning_tokens) filter (where reasoning is not null) as answer_tokens_mean,
        count(*) filter (where reasoning_cut) as reasoning_cut_by_budget,
        count(*) filter (where reasoning_tokens = output_tokens) as reasoning_unfinished,  -- its thought never closed
        avg(output_tokens) as output_tokens_mean,
        quantile_cont(output_tokens, 0.5) as output_tokens_p50,
        quantile_cont(output_tokens, 0.9) as output_tokens_p90,
        quantile_cont(output_tokens, 0.99) as output_tokens_p99,
        max(output_tokens) as output_tokens_max
    from requests
    group by run_id
),

texts as (
    select run_id, text, count(*) as n from requests group by run_id, text
),

dups as (  -- rows whose exact text at least one other row of the run also has
    select run_id, sum(n) filter (where n > 1) as duplicated_rows from texts group by run_id
),

errs as (
    select run_id, count(*) as errors from errors group by run_id
),

final as (
    select
        r.run_id,
        coalesce(p.outputs, 0) - coalesce(p.reused, 0) as generated,
        coalesce(p.reused, 0) as reused,
        coalesce(e.errors, 0) as errors,
        coalesce(p.finished_stop, 0) as finished_stop,
        coalesce(p.finished_length, 0) as finished_length,
        p.finished_length / nullif(p.outputs, 0) as length_share,
        coalesce(p.finished_repetition, 0) as finished_repetition,
        coalesce(p.with_reasoning, 0) as with_reasoning,
        p.reasoning_tokens_mean,
        p.answer_tokens_mean,
        coalesce(p.reasoning_cut_by_budget, 0) as reasoning_cut_by_budget,
        coalesce(p.reasoning_unfinished, 0) as reasoning_unfinished,
        p.output_tokens_mean,
        p.output_tokens_p50,
        p.output_tokens_p90,
        p.output_tokens_p99,
        p.output_tokens_max,
        coalesce(d.duplicated_rows, 0)::bigint as duplicated_rows,
        coalesce(d.duplicated_rows, 0) / nullif(p.outputs, 0) as duplicate_share
    from (select distinct run_id from runs) as r
    left join per_run as p using (run_id)
    left join errs as e using (run_id)
    left join dups as d using (run_id)
)

select * from final
order by run_id
