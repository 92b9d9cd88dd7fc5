-- What a run took and what it cost. machine_s adds up every attempt's time holding the engine
-- (model load, generation, writing; parallel workers each count), the time a machine is paid for;
-- window_s is the generation window alone. With a price (batchgen report --price-per-hour, i.e.
-- set variable price_per_hour = 3.5) the cost per million output tokens follows; without, null.
with attempts as (
    select run_id, unnest(from_json(doc -> '$.attempts', '["json"]')) as a
    from runs
),

machine as (
    select
        run_id,
        count(*) as attempts,
        sum((a ->> '$.ended_wall')::double - (a ->> '$.started_wall')::double) as machine_s
    from attempts
    group by run_id
),

final as (
    select
        t.run_id,
        coalesce(m.attempts, 0) as attempts,
        m.machine_s,
        t.window_s,
        t.output_tokens,
        getvariable('price_per_hour')::double as price_per_hour,
        getvariable('price_per_hour')::double * coalesce(m.machine_s, t.window_s) / 3600 as cost,
        getvariable('price_per_hour')::double * coalesce(m.machine_s, t.window_s) / 3600
            / nullif(t.output_tokens, 0) * 1e6 as cost_per_million_output_tokens,
        getvariable('price_per_hour')::double * t.window_s / 3600 / nullif(t.output_tokens, 0) * 1e6
            as generation_cost_per_million_output_tokens
    from throughput as t
    left join machine as m using (run_id)
)

select * from final
order by run_id
