"""Durable local writes and checksums: the primitives of the commit protocol (batchgen.data.run_dir)."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a new or renamed file) survive a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_write(path: Path, data: bytes, atomic: bool = True) -> None:
    """Write, fsync the file and its directory; `atomic` goes through a temporary name and a rename,
    so a reader sees the old content or the new, never a part."""
    target = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}") if atomic else path
    with open(target, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if atomic:
        os.replace(target, path)
    fsync_dir(path.parent)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
