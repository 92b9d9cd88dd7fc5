-- The run conditions as a table: one row per run (METRICS.md: every figure carries these).
with docs as (
    select run_id, doc from runs
),

lengths as (
    select
        run_id,
        quantile_cont(prompt_tokens, 0.5) as prompt_tokens_p50,
        max(prompt_tokens) as prompt_tokens_max,
        quantile_cont(output_tokens, 0.5) as output_tokens_p50,
        max(output_tokens) as output_tokens_max
    from generated
    group by run_id
),

final as (
    select
        d.run_id,
        json_extract_string(d.doc, '$.conditions.engine.engine') as engine,
        json_extract_string(d.doc, '$.conditions.engine.engine_version') as engine_version,
        json_extract_string(d.doc, '$.model') as model,
        json_extract_string(d.doc, '$.identity.model_fingerprint') as model_fingerprint,
        json_extract_string(d.doc, '$.conditions.engine.dtype') as dtype,
        coalesce(json_extract_string(d.doc, '$.conditions.engine.quantization'), 'none') as quantization,
        json_extract(d.doc, '$.conditions.engine.max_num_seqs')::bigint as max_num_seqs,
        json_extract(d.doc, '$.conditions.engine.max_model_len')::bigint as max_model_len,
        json_extract(d.doc, '$.conditions.engine.kv_budget_tokens')::bigint as kv_budget_tokens,
        json_extract(d.doc, '$.identity.sampling.temperature')::double as temperature,
        json_extract(d.doc, '$.identity.sampling.top_p')::double as top_p,
        json_extract(d.doc, '$.identity.sampling.top_k')::bigint as top_k,
        json_extract(d.doc, '$.identity.sampling.max_tokens')::bigint as max_tokens,
        coalesce(json_extract_string(d.doc, '$.conditions.engine.speculative'), 'none') as speculative,
        json_extract_string(d.doc, '$.conditions.engine.weight_layout') as weight_layout,
        json_extract_string(d.doc, '$.conditions.engine.compile') as compile,
        json_extract_string(d.doc, '$.conditions.engine.sampler') as sampler,
        json_extract_string(d.doc, '$.conditions.engine.cuda_graphs') as cuda_graphs,
        json_extract_string(d.doc, '$.conditions.engine.batch_invariant') as batch_invariant,
        -- the engine's plan as fields (batchgen.engine.plan; null for runs recorded before plans)
        json_extract(d.doc, '$.conditions.engine.plan.batch_invariant')::boolean as plan_batch_invariant,
        json_extract_string(d.doc, '$.conditions.engine.plan.weights') as plan_weights,
        json_extract_string(d.doc, '$.conditions.engine.plan.matmul') as plan_matmul,
        json_extract_string(d.doc, '$.conditions.engine.huge_pages') as huge_pages,
        json_extract_string(d.doc, '$.conditions.engine.admission') as admission,
        coalesce(json_extract_string(d.doc, '$.identity.shard_by'), 'order') as shard_by,
        l.prompt_tokens_p50,
        l.prompt_tokens_max,
        l.output_tokens_p50,
        l.output_tokens_max,
        coalesce(json_extract_string(d.doc, '$.conditions.hardware.gpu'),
                 json_extract_string(d.doc, '$.conditions.hardware.cpu')) as device_name,
        json_extract(d.doc, '$.conditions.hardware.cpu_cores')::bigint as cpu_cores,
        json_extract(d.doc, '$.conditions.hardware.peak_read_bytes_per_s')::double as peak_read_bytes_per_s,
        json_extract(d.doc, '$.conditions.hardware.peak_flops_fp32')::double as peak_flops_fp32,
        json_extract_string(d.doc, '$.conditions.software.batchgen_version') as batchgen_version,
        json_extract_string(d.doc, '$.conditions.software.git_commit') as git_commit
    from docs as d
    left join lengths as l using (run_id)
)

select * from final
order by run_id
