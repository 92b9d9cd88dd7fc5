-- Inter-token latency pooled over tokens (token-weighted, vLLM bench's ITL), classified by
-- context-length bucket (0-127, 128-255, ... powers of two) x concurrency bucket (1, 2-3, 4-7, ...).
with gaps as (
    select run_id, itl_s, context_len, concurrency
    from tokens
    where itl_s is not null
),

bucketed as (
    select
        run_id,
        itl_s,
        case when context_len < 128 then 0 else (2 ** floor(log2(context_len)))::bigint end as context_lo,
        (2 ** floor(log2(greatest(concurrency, 1))))::bigint as concurrency_lo
    from gaps
),

grouped as (  -- one quantile state per group: all three percentiles from a single sort
    select
        run_id,
        context_lo,
        concurrency_lo,
        count(*) as n,
        avg(itl_s) as mean_s,
        quantile_cont(itl_s, [0.5, 0.95, 0.99]) as q,
        max(itl_s) as max_s
    from bucketed
    group by all
),

final as (
    select
        run_id,
        context_lo,
        case when context_lo = 0 then 127 else context_lo * 2 - 1 end as context_hi,
        concurrency_lo,
        concurrency_lo * 2 - 1 as concurrency_hi,
        n,
        mean_s,
        q[1] as p50_s,
        q[2] as p95_s,
        q[3] as p99_s,
        max_s
    from grouped
)

select * from final
order by run_id, context_lo, concurrency_lo
