-- How far each run is: committed shards and rows against its input's. A run with fewer committed
-- shards than its input has is partial, and every figure of it covers the committed rows only. Of the
-- committed rows: generated here, reused (copied from an earlier run by --reuse-from), errors.
with expected as (
    select run_id, (doc ->> '$.input.shards')::bigint as shards, (doc ->> '$.input.rows')::bigint as rows
    from runs
),
committed as (
    select run_id, count(*) as shards_committed, sum(rows) as rows_committed, sum(ok - reused) as generated,
           sum(reused) as reused, sum(errors) as errors
    from manifests
    group by run_id
),
final as (
    select e.run_id, e.shards, coalesce(c.shards_committed, 0) as shards_committed,
           e.rows, coalesce(c.rows_committed, 0)::bigint as rows_committed,
           coalesce(c.generated, 0)::bigint as generated, coalesce(c.reused, 0)::bigint as reused,
           coalesce(c.errors, 0)::bigint as errors,
           coalesce(c.shards_committed, 0) < e.shards as partial
    from expected e left join committed c using (run_id)
)
select * from final order by run_id
