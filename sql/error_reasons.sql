-- Why rows failed, per run: errors grouped by stage and reason (the message with its numbers replaced
-- by N, so "prompt of 3012 tokens" and "prompt of 2990 tokens" are one reason), with counts, one full
-- message and up to five example ids.
with errs as (
    select run_id, stage, error, id, regexp_replace(error, '[0-9]+', 'N', 'g') as reason from errors
),

final as (
    select
        run_id,
        stage,
        reason,
        count(*) as n,
        min(error) as example_error,
        list(id order by id)[1:5] as example_ids
    from errs
    group by run_id, stage, reason
)

select * from final
order by run_id, n desc, reason
