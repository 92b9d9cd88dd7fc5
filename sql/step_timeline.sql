-- Every engine step: batch size over time, step time, prefill tokens, preemptions, prefix-cache hits,
-- KV blocks in use, and memory-bandwidth utilisation
-- MBU = bytes_read / step time / the peak read bandwidth measured for the run (METRICS.md).
with peak as (
    select run_id,
           json_extract(doc, '$.conditions.hardware.peak_read_bytes_per_s')::double as peak_read_bytes_per_s
    from runs
),

final as (
    select
        s.run_id,
        s.shard,
        s.step_id,
        s.start_t,
        s.end_t,
        s.end_t - s.start_t as step_s,
        s.num_running,
        s.num_waiting,
        s.num_prefill_tokens,
        s.num_decode_tokens,
        s.sum_context_len,
        s.bytes_read,
        s.num_preempted,
        s.num_cached_tokens,
        s.num_lookup_tokens,
        s.kv_blocks_used,
        s.kv_blocks_total,
        s.bytes_read / nullif(s.end_t - s.start_t, 0) / p.peak_read_bytes_per_s as mbu
    from steps as s
    left join peak as p using (run_id)
)

select * from final
order by run_id, start_t
