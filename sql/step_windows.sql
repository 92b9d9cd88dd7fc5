-- The step timeline for charting, aggregated, never thinned: a run's steps in start order are cut
-- into at most 1000 consecutive windows of equal step count (one step per window while a run has
-- 1000 steps or fewer; set variable step_windows = N for another count). Each window keeps the min and max of what varies (batch size, step time,
-- MBU) and the sums of what is counted (prefill tokens, preemptions, prefix-cache hits), so a stall
-- or a preemption burst inside a window still shows.
with ranked as (
    select
        *,
        row_number() over (partition by run_id order by start_t, shard, step_id) - 1 as rn,
        count(*) over (partition by run_id) as num_steps
    from step_timeline
),

final as (
    select
        run_id,
        rn * coalesce(getvariable('step_windows'), 1000)::bigint // num_steps as window_index,
        count(*) as steps,
        min(start_t) as start_t,
        max(end_t) as end_t,
        min(num_running) as min_running,
        max(num_running) as max_running,
        max(num_waiting) as max_waiting,
        min(step_s) as min_step_s,
        max(step_s) as max_step_s,
        sum(num_prefill_tokens)::bigint as prefill_tokens,
        sum(num_decode_tokens)::bigint as decode_tokens,
        sum(num_preempted)::bigint as preemptions,
        sum(num_cached_tokens)::bigint as prefix_cached_tokens,
        sum(num_lookup_tokens)::bigint as prefix_lookup_tokens,
        max(kv_blocks_used) as max_kv_blocks_used,
        max(kv_blocks_total) as kv_blocks_total,
        min(mbu) as min_mbu,
        max(mbu) as max_mbu
    from ranked
    group by run_id, window_index
)

select * from final
order by run_id, window_index
