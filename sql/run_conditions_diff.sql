-- Every run condition of every run, one row each, with `differs` set where the runs given
-- together do not agree on it: the figures of two runs are comparable only where nothing differs
-- but the thing being tested.
with conditions as (
    select run_id, columns(* exclude (run_id))::varchar
    from run_conditions
),

long as (
    unpivot conditions on columns(* exclude (run_id)) into name condition value value
),

final as (
    select
        l.run_id,
        l.condition,
        l.value,
        count(distinct coalesce(l.value, '<null>')) over (partition by l.condition) > 1 as differs
    from long as l
)

select * from final
order by condition, run_id
