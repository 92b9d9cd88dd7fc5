-- Runs side by side: headline figures, plus the run conditions that differ between them.
-- It reads the throughput and run_conditions queries as views (batchgen report creates them).
with conditions as (
    select run_id, columns(* exclude (run_id))::varchar
    from (select * exclude (git_commit, model_fingerprint) from run_conditions)
),

cond_long as (
    unpivot conditions on columns(* exclude (run_id)) into name condition value value
),

differing as (
    select condition from cond_long group by condition having count(distinct value) > 1
),

differing_per_run as (
    select c.run_id, string_agg(c.condition || '=' || c.value, ', ' order by c.condition) as differing_conditions
    from cond_long as c
    semi join differing as d using (condition)
    group by c.run_id
),

itl as (  -- pooled over all tokens
    select run_id, q[1] as itl_p50_s, q[2] as itl_p99_s
    from (
        select run_id, quantile_cont(itl_s, [0.5, 0.99]) as q
        from tokens
        where itl_s is not null
        group by run_id
    )
),

ttft as (
    select run_id, q[1] as ttft_p50_s, q[2] as ttft_p99_s, tpot_p50_s
    from (
        select run_id, quantile_cont(ttft_s, [0.5, 0.99]) as q, quantile_cont(tpot_s, 0.5) as tpot_p50_s
        from generated
        group by run_id
    )
),

final as (
    select
        t.run_id,
        t.num_requests,
        t.output_tokens,
        t.output_tok_per_s,
        t.requests_per_s,
        i.itl_p50_s,
        i.itl_p99_s,
        f.ttft_p50_s,
        f.ttft_p99_s,
        f.tpot_p50_s,
        coalesce(d.differing_conditions, '') as differing_conditions
    from throughput as t
    left join itl as i using (run_id)
    left join ttft as f using (run_id)
    left join differing_per_run as d using (run_id)
)

select * from final
order by run_id
