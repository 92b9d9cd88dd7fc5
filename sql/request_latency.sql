-- Per-request latency (METRICS.md): queue, TTFT, prefill, TPOT, E2E at p50/p90/p95/p99, mean, max, with n.
-- TPOT exists only for requests with at least two output tokens.
with metrics as (
    select * from (values ('queue_s'), ('ttft_s'), ('prefill_s'), ('tpot_s'), ('e2e_s')) as m (metric)
),

long as (  -- one row per request and metric; a null (no TPOT) still keeps its metric's group
    select
        r.run_id,
        m.metric,
        case m.metric
            when 'queue_s' then r.queue_s
            when 'ttft_s' then r.ttft_s
            when 'prefill_s' then r.prefill_s
            when 'tpot_s' then r.tpot_s
            else r.e2e_s
        end as seconds
    from generated as r
    cross join metrics as m
),

grouped as (
    select
        run_id,
        metric,
        count(seconds) as n,
        avg(seconds) as mean_s,
        quantile_cont(seconds, [0.5, 0.9, 0.95, 0.99]) as q,
        max(seconds) as max_s
    from long
    group by run_id, metric
),

final as (
    select run_id, metric, n, mean_s, q[1] as p50_s, q[2] as p90_s, q[3] as p95_s, q[4] as p99_s, max_s
    from grouped
)

select * from final
order by run_id, list_position(['queue_s', 'ttft_s', 'prefill_s', 'tpot_s', 'e2e_s'], metric)
