-- Outputs that more than one row of a run has, word for word: the 50 most repeated per run, with up
-- to five example ids (a dataset builder dedupes or regenerates these).
with texts as (
    select run_id, text, count(*) as n, list(id order by id, sample_index)[1:5] as example_ids
    from requests
    group by run_id, text
    having count(*) > 1
),

final as (
    select * from texts
    qualify row_number() over (partition by run_id order by n desc, text) <= 50
)

select * from final
order by run_id, n desc, text
