-- A sample of each run's rows to read: up to 500 per run, the same rows every time (ordered by a hash
-- of the id), with the prompt as given (null in runs made before requests/ held it), a thinking model's
-- reasoning, the output and how it ended.
with final as (
    select
        run_id,
        id,
        sample_index,
        prompt,
        reasoning,
        text as output,
        finish_reason,
        prompt_tokens,
        output_tokens,
        reused_from_run
    from requests
    qualify row_number() over (partition by run_id order by hash(id), sample_index) <= 500
)

select * from final
order by run_id, id, sample_index
