-- MBU over the run for charting: the step timeline thinned to about 1500 evenly spaced steps per run.
with ranked as (
    select
        run_id,
        start_t,
        num_running,
        mbu,
        row_number() over (partition by run_id order by start_t) as rn,
        count(*) over (partition by run_id) as num_steps
    from step_timeline
),

final as (
    select run_id, start_t, num_running, mbu
    from ranked
    where rn % greatest(num_steps // 1500, 1) = 0
)

select * from final
order by run_id, start_t
