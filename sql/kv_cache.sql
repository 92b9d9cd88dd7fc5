-- How the KV pool was used: preemptions (a request's blocks taken back and its tokens recomputed
-- later) and the prefix cache (prompt tokens served from cached blocks instead of computed).
-- Null where the engine does not report a figure.
with per_step as (
    select
        run_id,
        sum(num_preempted)::bigint as num_preemptions,
        sum(num_lookup_tokens)::bigint as prefix_lookup_tokens,
        sum(num_cached_tokens)::bigint as prefix_cached_tokens,
        sum(num_prefill_tokens)::bigint as prefill_tokens_computed,
        max(kv_blocks_used) as peak_kv_blocks_used,
        max(kv_blocks_total) as kv_blocks_total,
        max(num_running) as peak_running
    from steps
    group by run_id
),

per_request as (
    select run_id, count(*) filter (where num_preemptions > 0) as requests_preempted
    from generated
    group by run_id
),

final as (
    select
        s.run_id,
        s.num_preemptions,
        r.requests_preempted,
        s.prefix_lookup_tokens,
        s.prefix_cached_tokens,
        s.prefix_cached_tokens / nullif(s.prefix_lookup_tokens, 0) as prefix_hit_rate,
        s.prefill_tokens_computed,
        s.peak_running,
        s.peak_kv_blocks_used,
        s.kv_blocks_total,
        s.peak_kv_blocks_used / nullif(s.kv_blocks_total, 0) as peak_kv_usage
    from per_step as s
    left join per_request as r using (run_id)
)

select * from final
order by run_id
