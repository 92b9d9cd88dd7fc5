-- The run tables as views over one or many run directories.
-- First: set variable runs = ['runs/my-run'];   (globs work too: ['runs/*'])
-- Every view carries run_id (the run directory's name) and shard (the hive partition).
create or replace view requests as
select regexp_extract(filename, '([^/]+)/requests/shard=', 1) as run_id, * exclude (filename)
from read_parquet(list_transform(getvariable('runs'), lambda d: d || '/requests/*/*.parquet'),
                  hive_partitioning = true, filename = true, union_by_name = true);

create or replace view errors as
select regexp_extract(filename, '([^/]+)/errors/shard=', 1) as run_id, * exclude (filename)
from read_parquet(list_transform(getvariable('runs'), lambda d: d || '/errors/*/*.parquet'),
                  hive_partitioning = true, filename = true, union_by_name = true);

create or replace view tokens as
select regexp_extract(filename, '([^/]+)/tokens/shard=', 1) as run_id, * exclude (filename)
from read_parquet(list_transform(getvariable('runs'), lambda d: d || '/tokens/*/*.parquet'),
                  hive_partitioning = true, filename = true, union_by_name = true);

create or replace view steps as
select regexp_extract(filename, '([^/]+)/steps/shard=', 1) as run_id, * exclude (filename)
from read_parquet(list_transform(getvariable('runs'), lambda d: d || '/steps/*/*.parquet'),
                  hive_partitioning = true, filename = true, union_by_name = true);

-- run.json as one json document per run
create or replace view runs as
select regexp_extract(filename, '([^/]+)/run.json', 1) as run_id, json as doc
from read_json_objects(list_transform(getvariable('runs'), lambda d: d || '/run.json'), filename = true,
                       maximum_object_size = 1000000000);
