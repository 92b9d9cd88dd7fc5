-- Throughput against p99 latency across runs (a sweep over max_num_seqs, or any runs given
-- together): the curve a user picks a batch width from. A run is on the frontier when no other
-- run has at least its throughput at no more p99 ITL, and is strictly better in one of the two.
with per_run as (
    select
        c.run_id,
        c.max_num_seqs,
        c.dtype,
        t.output_tok_per_s,
        t.requests_per_s,
        i.p50_s as itl_p50_s,
        i.p99_s as itl_p99_s
    from run_conditions as c
    join throughput as t using (run_id)
    left join itl_overall as i using (run_id)
),

latency as (
    select
        run_id,
        quantile_cont(ttft_s, 0.99) as ttft_p99_s,
        quantile_cont(e2e_s, 0.99) as e2e_p99_s
    from generated
    group by run_id
),

final as (
    select
        p.*,
        l.ttft_p99_s,
        l.e2e_p99_s,
        p.itl_p99_s is not null and not exists (
            select 1 from per_run as o
            where o.run_id <> p.run_id and o.itl_p99_s is not null
              and o.output_tok_per_s >= p.output_tok_per_s and o.itl_p99_s <= p.itl_p99_s
              and (o.output_tok_per_s > p.output_tok_per_s or o.itl_p99_s < p.itl_p99_s)
        ) as on_frontier
    from per_run as p
    left join latency as l using (run_id)
)

select * from final
order by max_num_seqs, run_id
