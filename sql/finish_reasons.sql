-- How each run's rows ended: stop (EOS or a stop string), length (max_tokens or the context), error
-- (an errors/ row), with counts and each one's share of the run's rows.
with ends as (
    select run_id, finish_reason from requests
    union all
    select run_id, 'error' as finish_reason from errors
),

final as (
    select
        run_id,
        finish_reason,
        count(*) as n,
        count(*) / sum(count(*)) over (partition by run_id) as share
    from ends
    group by run_id, finish_reason
)

select * from final
order by run_id, n desc, finish_reason
