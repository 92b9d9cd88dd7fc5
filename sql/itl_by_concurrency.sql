-- Pooled inter-token latency by concurrency bucket (1, 2-3, 4-7, ...): the distribution to chart.
with bucketed as (
    select run_id, itl_s, (2 ** floor(log2(greatest(concurrency, 1))))::bigint as concurrency_lo
    from tokens
    where itl_s is not null
),

final as (
    select
        run_id,
        concurrency_lo,
        concurrency_lo * 2 - 1 as concurrency_hi,
        count(*) as n,
        avg(itl_s) as mean_s,
        quantile_cont(itl_s, 0.05) as p5_s,
        quantile_cont(itl_s, 0.25) as p25_s,
        quantile_cont(itl_s, 0.5) as p50_s,
        quantile_cont(itl_s, 0.75) as p75_s,
        quantile_cont(itl_s, 0.95) as p95_s,
        quantile_cont(itl_s, 0.99) as p99_s
    from bucketed
    group by all
)

select * from final
order by run_id, concurrency_lo
