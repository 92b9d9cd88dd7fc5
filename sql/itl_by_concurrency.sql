-- Pooled inter-token latency by concurrency bucket (1, 2-3, 4-7, ...): the distribution to chart.
with bucketed as (
    select run_id, itl_s, (2 ** floor(log2(greatest(concurrency, 1))))::bigint as concurrency_lo
    from tokens
    where itl_s is not null
),

grouped as (  -- one quantile state per group: all percentiles from a single sort
    select
        run_id,
        concurrency_lo,
        count(*) as n,
        avg(itl_s) as mean_s,
        quantile_cont(itl_s, [0.05, 0.25, 0.5, 0.75, 0.95, 0.99]) as q
    from bucketed
    group by all
),

final as (
    select
        run_id,
        concurrency_lo,
        concurrency_lo * 2 - 1 as concurrency_hi,
        n,
        mean_s,
        q[1] as p5_s,
        q[2] as p25_s,
        q[3] as p50_s,
        q[4] as p75_s,
        q[5] as p95_s,
        q[6] as p99_s
    from grouped
)

select * from final
order by run_id, concurrency_lo
