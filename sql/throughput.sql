-- Run-level throughput over the window from the first step's start to the last step's end, over the rows
-- generated in the run (rows copied from earlier runs by --reuse-from are counted apart: run_status).
with window_ as (
    select run_id, min(start_t) as first_start_t, max(end_t) as last_end_t, count(*) as num_steps
    from steps
    group by run_id
),

work as (
    select
        run_id,
        count(*) as num_requests,
        sum(output_tokens)::bigint as output_tokens,
        sum(prompt_tokens)::bigint as prompt_tokens
    from generated
    group by run_id
),

errs as (
    select run_id, count(*) as num_errors from errors group by run_id
),

final as (
    select
        w.run_id,
        k.num_requests,
        coalesce(e.num_errors, 0) as num_errors,
        k.output_tokens,
        k.prompt_tokens,
        w.num_steps,
        w.last_end_t - w.first_start_t as window_s,
        k.output_tokens / nullif(w.last_end_t - w.first_start_t, 0) as output_tok_per_s,
        (k.output_tokens + k.prompt_tokens) / nullif(w.last_end_t - w.first_start_t, 0) as total_tok_per_s,
        k.num_requests / nullif(w.last_end_t - w.first_start_t, 0) as requests_per_s
    from window_ as w
    join work as k using (run_id)
    left join errs as e using (run_id)
)

select * from final
order by run_id
