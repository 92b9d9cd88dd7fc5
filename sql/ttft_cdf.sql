-- The TTFT distribution as 100 quantiles per run (a CDF that stays small for any number of requests).
with per_run as (
    select run_id, quantile_cont(ttft_s, [x / 100 for x in range(1, 101)]) as values_s, count(*) as n
    from generated
    group by run_id
),

final as (
    select run_id, n, unnest(range(1, 101)) / 100.0 as fraction, unnest(values_s) as ttft_s
    from per_run
)

select * from final
order by run_id, fraction
