"""Streaming, validated reads of a Parquet prompt dataset, cut into deterministic shards.

Inputs: one file, several files, a directory (hive partitions included) or a glob, as local paths or
URIs (s3://bucket/prefix/*.parquet: batchgen.data.fs). Parquet is read in record batches, so memory
is bounded by the shard size, not the dataset. JSONL files (plain rows, or the OpenAI Batch API's
request lines: batchgen.data.formats) are read whole, file by file. Whole-input problems
(no prompt column, a wrong type, a corrupt file, duplicate ids, no rows) raise InputError with one
line that names the file and the column before any generation starts.
"""

from __future__ import annotations

import copy
import glob as globlib
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.data.errors import InputError
from batchgen.data.formats import is_jsonl, read_jsonl
from batchgen.data.fs import filesystem, is_uri
from batchgen.data.storage import sha256_file

PROMPT, MESSAGES, ID = "prompt", "messages", "id"
ROW = "_row"  # a staged row's number in the input (batchgen.data.order)
PARAM_COLUMNS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "n", "max_reasoning_tokens")
ROW_COLUMNS = ("stop", "system", "chat_template_kwargs", "response_format", "lora")  # per-row request options, checked row by row


def _data_file(name: str) -> bool:
    return name.endswith(".parquet") or is_jsonl(name)


def _expand_uri(item: str) -> list[str]:
    fs, path = filesystem(item)
    proto = item.split("://", 1)[0]
    if any(ch in item for ch in "*?["):
        matched = sorted(m for m in fs.glob(path) if fs.isfile(m))
        if not matched:
            raise InputError(f"{item}: no files match this glob")
        return [f"{proto}://{m}" for m in matched]
    if fs.isfile(path):
        return [item]
    if fs.isdir(path):
        root = path.rstrip("/")
        found = sorted(f for f in fs.find(root) if _data_file(f) and not any(
            part.startswith((".", "_")) for part in f[len(root) + 1:].split("/")))
        if not found:
            raise InputError(f"{item}: holds no .parquet or .jsonl files")
        return [f"{proto}://{f}" for f in found]
    raise InputError(f"{item}: no such file or prefix")


def expand_inputs(inputs: tuple[str, ...] | list[str]) -> list[str]:
    files: list[str] = []
    for item in inputs:
        if is_uri(item):
            files += _expand_uri(item)
            continue
        if any(ch in item for ch in "*?["):
            matched = [m for m in sorted(globlib.glob(item, recursive=True)) if os.path.isfile(m)]
            if not matched:
                raise InputError(f"{item}: no files match this glob")
            files += matched
        elif os.path.isdir(item):
            found = sorted(str(p) for p in Path(item).rglob("*") if p.is_file() and _data_file(p.name)
                           and not any(part.startswith((".", "_")) for part in p.relative_to(item).parts))
            if not found:
                raise InputError(f"{item}: directory holds no .parquet or .jsonl files")
            files += found
        elif os.path.isfile(item):
            files.append(item)
        else:
            raise InputError(f"{item}: no such file or directory")
    return files


def _plain(t: pa.DataType) -> pa.DataType:
    """The type a column is read as: dictionary-encoded values decoded, large strings as strings,
    integers as int64 (a uint64 stays, so an out-of-range value reaches its row's check)."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_large_string(t):
        return pa.string()
    if pa.types.is_integer(t) and not t == pa.uint64():
        return pa.int64()
    if pa.types.is_floating(t):
        return pa.float64()
    return t


def _read_bytes(f: str) -> bytes:
    if is_uri(f):
        fs, p = filesystem(f)
        return fs.cat_file(p)
    with open(f, "rb") as fh:
        return fh.read()


def _parquet(f: str) -> pq.ParquetFile:
    """A Parquet file, local or behind a URI (read through fsspec, footer first, then row groups)."""
    if is_uri(f):
        fs, p = filesystem(f)
        try:
            return pq.ParquetFile(fs.open(p, "rb", block_size=1 << 23))
        except FileNotFoundError:
            raise InputError(f"{f}: no such object") from None
    return pq.ParquetFile(f)


def _identity(f: str) -> str:
    """What identifies a file's content: local, its absolute path, size and sha256; on an object
    store, its URI, size and ETag (the store's own content tag), or a sha256 where there is none."""
    if not is_uri(f):
        return f"{os.path.abspath(f)}|{os.path.getsize(f)}|{sha256_file(Path(f))}"
    fs, p = filesystem(f)
    info = fs.info(p)
    tag = info.get("ETag") or info.get("etag") or info.get("md5Hash")
    if not tag:
        h = hashlib.sha256(fs.cat_file(p))
        tag = h.hexdigest()
    return f"{f}|{info.get('size')}|{str(tag).strip(chr(34))}"


class InvalidValue:
    """A value that could not be read (invalid UTF-8): its row becomes an error row, not a crash."""

    def __init__(self, reason: str):
        self.reason = reason


@dataclass
class Shard:
    index: int
    table: pa.Table  # columns: id (string) + prompt/messages + parameter columns present
    first_row: int

    def rows(self) -> Iterator[dict]:
        """The rows as dicts; a value that cannot be decoded reads as InvalidValue."""
        try:
            yield from self.table.to_pylist()
            return
        except (UnicodeDecodeError, pa.ArrowInvalid):
            pass
        columns = {c: self.table.column(c) for c in self.table.column_names}
        for i in range(self.table.num_rows):
            row = {}
            for c, col in columns.items():
                try:
                    row[c] = col[i].as_py()
                except (UnicodeDecodeError, pa.ArrowInvalid) as e:
                    row[c] = InvalidValue(f"column {c!r} is not valid UTF-8 ({e})")
            yield row


class PromptDataset:
    """A validated prompt dataset; iterate `shards(size)` to stream it."""

    def __init__(self, inputs: tuple[str, ...] | list[str], keep_columns: tuple[str, ...] | list[str] = ()):
        self.files = expand_inputs(inputs)
        self.keep_columns = list(keep_columns)
        self.num_rows = 0
        self._rows_per_file: list[tuple[str, int]] = []
        self._jsonl: dict[str, pa.Table] = {}  # JSONL inputs, read whole
        self._staged: str | None = None  # the rows in another order (ordered_by)
        file_schemas: list[pa.Schema] = []
        for f in self.files:
            if is_jsonl(f):
                table = self._jsonl[f] = read_jsonl(_read_bytes(f), f)
                file_schemas.append(table.schema)
                self.num_rows += table.num_rows
                self._rows_per_file.append((f, table.num_rows))
                continue
            try:
                meta = _parquet(f).metadata
                file_schemas.append(meta.schema.to_arrow_schema())
            except InputError:
                raise
            except Exception as e:  # noqa: BLE001 - pyarrow raises several types for bad files
                raise InputError(f"{f}: not a readable Parquet file ({type(e).__name__}: {str(e).splitlines()[0]})") from None
            self.num_rows += meta.num_rows
            self._rows_per_file.append((f, meta.num_rows))
        plain = [pa.schema([pa.field(fl.name, _plain(fl.type)) for fl in sc]) for sc in file_schemas]
        try:
            self.schema = pa.unify_schemas(plain, promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise InputError(f"{self.files[0]}: the files' schemas do not agree ({str(e).splitlines()[0]})") from None
        self._validate_schema()
        for f, sc in zip(self.files, file_schemas):  # each file must carry the prompt: no silent null rows
            if self.prompt_column not in sc.names:
                raise InputError(f"{f}: no {self.prompt_column!r} column, which the other input files have "
                                 f"(columns: {', '.join(sc.names)})")
        if self.num_rows == 0:
            raise InputError(f"{self._where()}: the dataset has no rows")
        self._check_ids()

    def _where(self) -> str:
        return self.files[0] if len(self.files) == 1 else f"{self.files[0]} (+{len(self.files) - 1} files)"

    def _validate_schema(self) -> None:
        names = self.schema.names
        if PROMPT not in names and MESSAGES not in names:
            raise InputError(f"{self._where()}: no 'prompt' or 'messages' column (columns: {', '.join(names)})")
        if PROMPT in names:
            t = self.schema.field(PROMPT).type
            if not pa.types.is_string(t):
                raise InputError(f"{self._where()}: column 'prompt' must be string, found {t}")
            self.prompt_column = PROMPT
        else:
            t = self.schema.field(MESSAGES).type
            ok = pa.types.is_string(t) or (
                (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_struct(t.value_type))
            if not ok:
                raise InputError(f"{self._where()}: column 'messages' must be list<struct<role, content>> "
                                 f"or a JSON string, found {t}")
            self.prompt_column = MESSAGES
        if ID in names:
            t = self.schema.field(ID).type
            if not (pa.types.is_string(t) or pa.types.is_integer(t)):
                raise InputError(f"{self._where()}: column 'id' must be string or integer, found {t}")
        missing = [c for c in self.keep_columns if c not in names]
        if missing:
            raise InputError(f"{self._where()}: --keep-columns names {', '.join(repr(c) for c in missing)}, which the "
                             f"input does not have (columns: {', '.join(names)})")
        wanted = (ID, self.prompt_column, *PARAM_COLUMNS, *ROW_COLUMNS, *self.keep_columns)
        self.columns = [c for c in dict.fromkeys(wanted) if c in names]

    def _check_ids(self) -> None:
        if ID not in self.schema.names:
            return
        ids = self.ids()
        if ids.null_count:
            raise InputError(f"{self._where()}: column 'id' has {ids.null_count} null values")
        if pc.count_distinct(ids).as_py() != len(ids):
            counts = pc.value_counts(ids)
            dup = next(v["values"] for v in counts.to_pylist() if v["counts"] > 1)
            raise InputError(f"{self._where()}: column 'id' has duplicate values (e.g. {dup!r})")

    def ids(self) -> pa.Array:
        """Every row's id as a string, in row order (the row number where there is no id column)."""
        if ID not in self.schema.names:
            return pa.array([str(i) for i in range(self.num_rows)], pa.string())
        parts = []
        for f in self.files:
            col = self._jsonl[f].column(ID) if f in self._jsonl else _parquet(f).read(columns=[ID]).column(ID)
            col = col.cast(_plain(col.type)).cast(pa.string())
            try:
                col.validate(full=True)
            except pa.ArrowInvalid:
                raise InputError(f"{f}: column 'id' holds invalid UTF-8; ids must be readable text") from None
            parts += col.chunks
        return pa.chunked_array(parts, pa.string()).combine_chunks() if parts else pa.array([], pa.string())

    def fingerprint(self) -> str:
        """Identifies the input by its content: each file's path, size and sha256, and the schema.
        A file rewritten in place (same size, same row count) is a different input."""
        h = hashlib.sha256()
        for f in self.files:
            h.update(f"{_identity(f)}\n".encode())
        h.update(str(self.schema).encode())
        return h.hexdigest()[:16]

    def ordered_by(self, staged: str) -> "PromptDataset":
        """This dataset, its rows read from `staged`: the same rows in another order, written by
        batchgen.data.order with each row's input row number in ROW. Ids, fingerprint and schema stay
        the input's."""
        other = copy.copy(self)
        other._staged = staged
        return other

    def num_shards(self, shard_size: int) -> int:
        return -(-self.num_rows // shard_size)

    def shards(self, shard_size: int) -> Iterator[Shard]:
        """Deterministic shards of `shard_size` rows, in file order then row order, in one streaming pass."""
        pending: list[pa.Table] = []
        pending_rows, index = 0, 0
        for piece in self.pieces(0, self.num_rows):
            pending.append(piece)
            pending_rows += piece.num_rows
            while pending_rows >= shard_size:
                table = pa.concat_tables(pending)
                yield self._shard(index, table.slice(0, shard_size), index * shard_size)
                rest = table.slice(shard_size)
                pending, pending_rows = [rest], rest.num_rows
                index += 1
        if pending_rows:
            yield self._shard(index, pa.concat_tables(pending), index * shard_size)

    def read_shard(self, index: int, shard_size: int) -> Shard:
        """Rows [index * size, (index + 1) * size), so any worker can read any shard. Only the row
        groups that hold them are read, in batches, so memory stays bounded by the shard."""
        lo, hi = index * shard_size, min((index + 1) * shard_size, self.num_rows)
        if not 0 <= lo < hi:
            raise IndexError(f"shard {index} is out of range ({self.num_shards(shard_size)} shards)")
        return self._shard(index, pa.concat_tables(list(self.pieces(lo, hi))), lo)

    def pieces(self, lo: int, hi: int, batch_size: int = 4096) -> Iterator[pa.Table]:
        """Tables covering the global rows [lo, hi), normalised to the unified schema."""
        offset = 0
        for path, n_rows in self._file_rows():
            f_lo, f_hi = max(lo - offset, 0), min(hi - offset, n_rows)
            offset += n_rows
            if f_lo >= f_hi:
                continue
            if path in self._jsonl:
                table = self._jsonl[path]
                present = [c for c in self.columns if c in table.column_names]
                for b0 in range(f_lo, f_hi, batch_size):
                    yield self._normalise(table.slice(b0, min(batch_size, f_hi - b0)).select(present), present)
                continue
            pf = _parquet(path)
            groups, start, pos = [], 0, None
            for g in range(pf.num_row_groups):
                n = pf.metadata.row_group(g).num_rows
                if start < f_hi and start + n > f_lo:
                    groups.append(g)
                    pos = start if pos is None else pos
                start += n
            present = [c for c in (*self.columns, ROW) if c in pf.schema_arrow.names]
            for batch in pf.iter_batches(batch_size=batch_size, row_groups=groups, columns=present):
                b_lo, b_hi = max(f_lo, pos), min(f_hi, pos + batch.num_rows)
                if b_lo < b_hi:
                    yield self._normalise(pa.Table.from_batches([batch.slice(b_lo - pos, b_hi - b_lo)]), present)
                pos += batch.num_rows
                if pos >= f_hi:
                    break

    def _file_rows(self) -> list[tuple[str, int]]:
        return [(self._staged, self.num_rows)] if self._staged else self._rows_per_file

    def _normalise(self, table: pa.Table, present: list[str]) -> pa.Table:
        columns = {}
        for c in self.columns:  # a column missing from this file reads as nulls
            field = self.schema.field(c)
            columns[c] = table.column(c).cast(field.type) if c in present else pa.nulls(table.num_rows, field.type)
        if ROW in present:
            columns[ROW] = table.column(ROW)
        return pa.table(columns)

    def _shard(self, index: int, table: pa.Table, first_row: int) -> Shard:
        if ROW in table.column_names:  # staged: the row numbers are the input's, not the position's
            rows = table.column(ROW)
            table = table.drop_columns([ROW])
            if ID not in table.column_names:
                table = table.add_column(0, ID, pc.cast(rows, pa.string()))
        if ID in table.column_names:
            ids = table.column(ID).cast(pa.string())
            table = table.set_column(table.column_names.index(ID), ID, ids)
        else:
            ids = pa.array([str(first_row + i) for i in range(table.num_rows)], pa.string())
            table = table.add_column(0, ID, ids)
        return Shard(index, table.combine_chunks(), first_row)
