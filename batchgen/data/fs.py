"""Where data lives: local paths and URIs (s3://bucket/prefix, gs://, ...) behind one small interface.

A `Store` is a root (a local directory or an object-store prefix) resolved by fsspec, which reads
credentials and the endpoint the standard ways (for S3, botocore's chain: AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY / AWS_PROFILE, AWS_ENDPOINT_URL). Paths inside it are relative, with "/".

What the commit protocol (batchgen.data.run_dir) needs from storage, and how each kind provides it:
- `write`: a whole object at once. Local: a temporary name, fsync, rename, fsync of the directory
  (or in place, for names nobody else writes). Object store: one PUT, which is atomic (readers see
  the old object or the new, never a part) but is not a rename: so nothing relies on renames.
- `create_exclusive` / `read_versioned` / `replace_if`: conditional writes, the compare-and-swap
  behind leases. S3: `If-None-Match: *` and `If-Match: <ETag>` (HTTP 412 when someone else won).
  Local leases use flock instead (batchgen.data.lock), so these are for object stores.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from batchgen.data.storage import durable_write, fsync_dir, sha256_file


def is_uri(location: str | Path) -> bool:
    s = str(location)
    return "://" in s and not s.startswith("file://")


def join(location: str, *parts: str) -> str:
    """`location` / parts, for local paths and URIs alike."""
    if is_uri(location):
        return "/".join([str(location).rstrip("/"), *parts])
    return str(Path(location, *parts))


def basename(location: str | Path) -> str:
    return str(location).rstrip("/").rsplit("/", 1)[-1]


def filesystem(location: str | Path):
    """(fsspec filesystem, path inside it) for a local path or a URI."""
    import fsspec.core

    # no listing cache: other processes (resumes, Ray workers) change what is there, and the protocol
    # must see the store as it is now
    try:
        return fsspec.core.url_to_fs(str(location), use_listings_cache=False)
    except TypeError:
        return fsspec.core.url_to_fs(str(location))


class PreconditionFailed(Exception):
    """A conditional write lost: the object exists (create) or changed (replace)."""


class OutcomeUnknown(Exception):
    """A conditional write's response never came (a timeout, a reset): the store may or may not have
    applied it. Only a read tells (batchgen.data.lock resolves it so)."""


# the client's errors that leave a request's outcome unknown: the request may have reached the store
_UNANSWERED = ("ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError", "EndpointConnectionError",
               "ResponseStreamingError", "ConnectionResetError", "ConnectionError", "TimeoutError", "IncompleteRead",
               "ProtocolError", "ServerDisconnectedError", "ClientOSError", "ClientPayloadError")


class Store:
    def __init__(self, location: str | Path):
        self.location = str(location).rstrip("/") if is_uri(location) else str(Path(location))
        self.local = not is_uri(location)
        if self.local:
            self.fs, self.root = None, Path(self.location)
        else:
            self.fs, self.root = filesystem(self.location)
            self.root = str(self.root).rstrip("/")

    def __repr__(self) -> str:
        return self.location

    # ---- names ----------------------------------------------------------------------------------

    def path(self, rel: str) -> str:
        """The name a reader outside batchgen uses: a local path, or the full URI."""
        return str(self.root / rel) if self.local else f"{self.location}/{rel}"

    def _key(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    # ---- reads ----------------------------------------------------------------------------------

    def exists(self, rel: str) -> bool:
        return (self.root / rel).is_file() if self.local else self.fs.isfile(self._key(rel))

    def read_bytes(self, rel: str) -> bytes:
        """Raises FileNotFoundError when absent."""
        if self.local:
            return (self.root / rel).read_bytes()
        return self.fs.cat_file(self._key(rel))

    def size(self, rel: str) -> int:
        return (self.root / rel).stat().st_size if self.local else int(self.fs.size(self._key(rel)))

    def sha256(self, rel: str) -> str:
        if self.local:
            return sha256_file(self.root / rel)
        h = hashlib.sha256()
        with self.fs.open(self._key(rel), "rb", block_size=1 << 22) as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        return h.hexdigest()

    def list(self, rel: str) -> list[str]:
        """Relative names of the files directly under `rel` (none if it does not exist), sorted."""
        if self.local:
            d = self.root / rel
            return sorted(f"{rel}/{p.name}" for p in d.iterdir() if p.is_file()) if d.is_dir() else []
        try:
            entries = self.fs.ls(self._key(rel), detail=True, refresh=True)
        except FileNotFoundError:
            return []
        n = len(self.root) + 1
        return sorted(e["name"][n:] for e in entries if e["type"] == "file")

    def open_input(self, rel: str):
        """A seekable binary file for pyarrow (Parquet footers are read from the end)."""
        return open(self.root / rel, "rb") if self.local else self.fs.open(self._key(rel), "rb", block_size=1 << 23)

    # ---- writes ---------------------------------------------------------------------------------

    def makedirs(self, rel: str = "") -> None:
        if self.local:
            (self.root / rel).mkdir(parents=True, exist_ok=True)
        # object stores have no directories

    def write(self, rel: str, data: bytes, atomic: bool = True) -> None:
        """The whole object, durably. `atomic=False` (local) writes in place: only for a name that is
        unique to the writer, where no reader can see it before a manifest names it."""
        if self.local:
            p = self.root / rel
            if not p.parent.is_dir():
                p.parent.mkdir(parents=True, exist_ok=True)
                fsync_dir(p.parent.parent)  # the new directory's own entry must survive a power cut too
            durable_write(p, data, atomic=atomic)
        else:
            self.fs.pipe_file(self._key(rel), data)

    def put_file(self, rel: str, local: Path) -> None:
        """A local file, streamed in, durably and whole (local: copied under a temporary name, then renamed)."""
        if self.local:
            import shutil

            p = self.root / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
            shutil.copyfile(local, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, p)
            fsync_dir(p.parent)
        else:
            self.fs.put_file(str(local), self._key(rel))

    def delete(self, rel: str) -> None:
        if self.local:
            (self.root / rel).unlink(missing_ok=True)
        else:
            try:
                self.fs.rm_file(self._key(rel))
            except FileNotFoundError:
                pass

    def delete_tree(self, rel: str) -> None:
        if self.local:
            import shutil

            shutil.rmtree(self.root / rel, ignore_errors=True)
        else:
            for name in self.list_recursive(rel):
                self.delete(name)

    def list_recursive(self, rel: str) -> list[str]:
        if self.local:
            d = self.root / rel
            return sorted(str(p.relative_to(self.root)) for p in d.rglob("*") if p.is_file()) if d.is_dir() else []
        try:
            found = self.fs.find(self._key(rel))
        except FileNotFoundError:
            return []
        n = len(self.root) + 1
        return sorted(f[n:] for f in found)

    # ---- conditional writes (object stores) --------------------------------------------------------

    def _s3(self):
        if self.local or not hasattr(self.fs, "call_s3"):
            raise NotImplementedError(f"{self.location}: conditional writes are implemented for S3 only")
        bucket, _, key_prefix = self.root.partition("/")
        return bucket, key_prefix

    def _s3_key(self, rel: str) -> tuple[str, str]:
        bucket, prefix = self._s3()
        return bucket, f"{prefix}/{rel}" if prefix else rel

    def read_versioned(self, rel: str) -> tuple[bytes, str] | None:
        """(content, version tag) or None when absent; pass the tag to `replace_if`."""
        bucket, key = self._s3_key(rel)
        try:
            r = self.fs.call_s3("get_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return None
        import inspect

        body = r["Body"]
        if inspect.iscoroutinefunction(getattr(body, "read", None)):  # aiobotocore's stream, under s3fs
            import fsspec.asyn

            data = fsspec.asyn.sync(self.fs.loop, body.read)
        else:
            data = body.read()
        return data, r["ETag"]

    def create_exclusive(self, rel: str, data: bytes) -> None:
        """Create the object only if there is none (If-None-Match: *); PreconditionFailed otherwise."""
        self._conditional_put(rel, data, IfNoneMatch="*")

    def replace_if(self, rel: str, data: bytes, version: str) -> None:
        """Replace the object only if it is still at `version` (If-Match); PreconditionFailed otherwise."""
        self._conditional_put(rel, data, IfMatch=version)

    def _conditional_put(self, rel: str, data: bytes, **condition) -> None:
        bucket, key = self._s3_key(rel)
        try:
            self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
        except Exception as e:  # s3fs maps errors to OSError subclasses; 412/409 mean "lost the race"
            text = f"{type(e).__name__} {e} {getattr(e, '__cause__', '')}"
            if any(s in text for s in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")):
                raise PreconditionFailed(rel) from None
            chain, cause = [], e
            while cause is not None and len(chain) < 8:
                chain.append(type(cause).__name__)
                cause = cause.__cause__ or cause.__context__
            if any(name in _UNANSWERED for name in chain):
                raise OutcomeUnknown(f"{type(e).__name__}: {e}") from e
            raise
        self.fs.invalidate_cache(self._key(rel))
