-- The run tables as views over one or many run directories.
-- First: set variable runs = ['runs/my-run'];   (globs work too: ['runs/*'])
-- Only committed data is read: the files that a shard's manifest (_manifests/shard=N.json, the
-- commit record) names. Files of unfinished or dead attempts are never seen.
-- Every view carries run_id (the run directory's name) and shard (the hive partition).
create or replace view manifests as
select regexp_extract(filename, '([^/]+)/_manifests/shard=', 1) as run_id,
       regexp_replace(filename, '/_manifests/[^/]+$', '') as run_dir, shard, rows, ok, errors,
       coalesce(reused, 0) as reused, files
from read_json(list_transform(getvariable('runs'), lambda d: d || '/_manifests/shard=*.json'), filename = true,
               union_by_name = true, columns = {shard: 'bigint', rows: 'bigint', ok: 'bigint', errors: 'bigint',
               reused: 'bigint',
               files: 'struct("table" varchar, path varchar, "rows" bigint, bytes bigint, sha256 varchar)[]'});

set variable committed_files = (
    with f as (select run_dir, unnest(files) as file from manifests)
    select list(run_dir || '/' || file.path order by run_dir, file.path) from f);

-- (runs written before request keys, each row's prompt or the reasoning columns existed read with
-- those columns null)
create or replace view requests as
select regexp_extract(filename, '([^/]+)/requests/shard=', 1) as run_id, * exclude (filename)
from (select * from read_parquet(list_filter(getvariable('committed_files'), lambda p: p like '%/requests/shard=%'),
                                 hive_partitioning = true, filename = true, union_by_name = true)
      union all by name
      select null::varchar as request_key, null::varchar as reused_from_run, null::varchar as prompt,
             null::varchar as reasoning, null::integer as reasoning_tokens, null::boolean as reasoning_cut where false);

-- the rows this run generated: what every latency and throughput figure is made of. A row copied from
-- an earlier run (--reuse-from: reused_from_run set) has no timings of its own and is counted apart.
create or replace view generated as
select * from requests where reused_from_run is null;

create or replace view errors as
select regexp_extract(filename, '([^/]+)/errors/shard=', 1) as run_id, * exclude (filename)
from read_parquet(list_filter(getvariable('committed_files'), lambda p: p like '%/errors/shard=%'),
                  hive_partitioning = true, filename = true, union_by_name = true);

create or replace view tokens as
select regexp_extract(filename, '([^/]+)/tokens/shard=', 1) as run_id, * exclude (filename)
from read_parquet(list_filter(getvariable('committed_files'), lambda p: p like '%/tokens/shard=%'),
                  hive_partitioning = true, filename = true, union_by_name = true);

create or replace view steps as
select regexp_extract(filename, '([^/]+)/steps/shard=', 1) as run_id, * exclude (filename)
from read_parquet(list_filter(getvariable('committed_files'), lambda p: p like '%/steps/shard=%'),
                  hive_partitioning = true, filename = true, union_by_name = true);

-- run.json as one json document per run; run_order is the run's place in the list given (the first is
-- the baseline that run_delta compares against), null for a run matched by a glob
create or replace view runs as
select regexp_extract(filename, '([^/]+)/run.json', 1) as run_id,
       list_position(getvariable('runs'), regexp_replace(filename, '/run.json$', '')) as run_order,
       json as doc
from read_json_objects(list_transform(getvariable('runs'), lambda d: d || '/run.json'), filename = true,
                       maximum_object_size = 1000000000);
