-- Inter-token latency per step: with speculative decoding one step can emit several tokens of a
-- request (they share its time, so their token ITL is 0). Here each request's (each sample's) gaps are taken between
-- the distinct steps that produced its tokens, alongside how many tokens those steps emitted.
with request_steps as (
    select run_id, shard, request_id, sample_index, step_id, any_value(t) as t, count(*) as tokens_in_step
    from tokens
    group by all
),

gaps as (
    select
        run_id,
        tokens_in_step,
        t - lag(t) over (partition by run_id, shard, request_id, sample_index order by t, step_id) as step_gap_s
    from request_steps
),

final as (
    select
        run_id,
        count(step_gap_s) as n,
        avg(tokens_in_step) as mean_tokens_per_step,
        max(tokens_in_step) as max_tokens_per_step,
        avg(step_gap_s) as mean_s,
        quantile_cont(step_gap_s, [0.5, 0.95, 0.99]) as q
    from gaps
    group by run_id
)

select run_id, n, mean_tokens_per_step, max_tokens_per_step, mean_s, q[1] as p50_s, q[2] as p95_s, q[3] as p99_s
from final
order by run_id
