-- Inter-token latency pooled over every token of the run (vLLM bench's ITL): the one row that
-- answers "what was the ITL?" before any bucketing by context length or concurrency.
with grouped as (
    select
        run_id,
        count(*) as n,
        avg(itl_s) as mean_s,
        quantile_cont(itl_s, [0.5, 0.9, 0.95, 0.99]) as q,
        max(itl_s) as max_s
    from tokens
    where itl_s is not null
    group by run_id
),

final as (
    select run_id, n, mean_s, q[1] as p50_s, q[2] as p90_s, q[3] as p95_s, q[4] as p99_s, max_s
    from grouped
)

select * from final
order by run_id
