-- Run A against run B: each headline figure of every run beside the baseline's (the first run
-- given), with the difference and the relative change. run_conditions_diff says what differed.
with baseline as (
    select run_id from runs order by run_order nulls last, run_id limit 1
),

long as (
    unpivot (
        select run_id, output_tok_per_s, requests_per_s, itl_p50_s, itl_p99_s, ttft_p50_s, ttft_p99_s,
               tpot_p50_s, num_requests::double as num_requests
        from run_comparison
    ) on columns(* exclude (run_id)) into name metric value value
),

final as (
    select
        l.run_id,
        b.run_id as baseline_run_id,
        l.metric,
        l.value,
        bl.value as baseline_value,
        l.value - bl.value as delta,
        (l.value - bl.value) / nullif(bl.value, 0) as delta_pct,
        -- which way is better: more throughput, less latency
        case when l.metric in ('output_tok_per_s', 'requests_per_s', 'num_requests') then 'higher' else 'lower' end
            as better
    from long as l
    cross join baseline as b
    join long as bl on bl.run_id = b.run_id and bl.metric = l.metric
)

select * from final
order by list_position(['output_tok_per_s', 'requests_per_s', 'itl_p50_s', 'itl_p99_s', 'ttft_p50_s',
                        'ttft_p99_s', 'tpot_p50_s', 'num_requests'], metric), run_id
