-- The distribution of output lengths per run, as a histogram of about 20 equal bins (bin_start ..
-- bin_start + bin_width - 1 tokens); the report draws it.
with widths as (
    select run_id, greatest(1, ceil((max(output_tokens) + 1) / 20.0))::bigint as bin_width
    from requests
    group by run_id
),

final as (
    select
        r.run_id,
        (r.output_tokens // w.bin_width) * w.bin_width as bin_start,
        w.bin_width,
        count(*) as n
    from requests as r
    join widths as w using (run_id)
    group by r.run_id, bin_start, w.bin_width
)

select * from final
order by run_id, bin_start
