-- Output tokens per second in fixed windows (set variable window_s = 5.0; default 1 second).
with params as (
    select coalesce(getvariable('window_s'), 1.0)::double as window_s
),

binned as (
    select tokens.run_id, floor(tokens.t / params.window_s)::bigint as window_index, params.window_s
    from tokens, params
),

final as (
    select
        run_id,
        window_index * any_value(window_s) as window_start_t,
        any_value(window_s) as window_s,
        count(*) as output_tokens,
        count(*) / any_value(window_s) as output_tok_per_s
    from binned
    group by run_id, window_index
)

select * from final
order by run_id, window_start_t
