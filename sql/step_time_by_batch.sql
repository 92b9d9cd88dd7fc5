-- Decode steps grouped by batch size: step time and throughput against the number of running sequences.
-- Steps with a prefill are left out: they do a different amount of work per token.
with decode_steps as (
    select run_id, num_running, end_t - start_t as step_s, num_decode_tokens
    from steps
    where num_prefill_tokens = 0 and num_decode_tokens > 0
),

final as (
    select
        run_id,
        num_running,
        count(*) as n,
        avg(step_s) as mean_step_s,
        quantile_cont(step_s, 0.5) as p50_step_s,
        quantile_cont(step_s, 0.95) as p95_step_s,
        sum(num_decode_tokens) / sum(step_s) as output_tok_per_s
    from decode_steps
    group by all
)

select * from final
order by run_id, num_running
