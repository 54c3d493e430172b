"""A checkpoint's proof that it is complete: ``manifest.json``, every file it holds with its
size and CRC32, written last, just before the directory is renamed into place.

A checkpoint directory without a readable manifest, or with a file missing, of another size
or of another checksum than the manifest says, is damaged: a save killed half-way (never
renamed, so never seen, but a host crash can lose the page cache after the rename), a disk
that filled up, a file truncated or overwritten by hand. ``learner.runtime.checkpoint`` skips
such a checkpoint when resuming from the newest, and refuses it when named explicitly; the
problem names the file (``policy/ds/mp_rank_00_model_states.pt has 1048576 bytes, the
manifest says 1583422611``).

Why CRC32 and not a cryptographic hash: the manifest guards against accidents, not an
adversary (who could rewrite the manifest too), and sizes already catch truncation. Measured
with ``bench/checkpoint_manifest.py`` on a SmolLM2-135M-shaped DeepSpeed checkpoint (1.6 GB
fp32, 1.9 GB bf16; 2 shared CPU cores): zlib's CRC32 hashes it in 0.3-1.1 s (1.5-4.9 GB/s),
SHA-256 about three times slower, against 1.8-4.4 s for DeepSpeed's own save into the page
cache and 3-4.6 s for a durable one; docs/checkpoints.md has the table. So the checksums are
always on. The work is split over the ranks (``shares``): each hashes about its own bytes.

This module only reads and writes files (no torch), so the verification is testable alone.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT = 1
ALGORITHM = "crc32"
_CHUNK = 8 << 20


def file_sizes(directory: Path) -> dict[str, int]:
    """Every regular file under ``directory`` (relative POSIX path -> bytes), the manifest aside."""
    out = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            out[path.relative_to(directory).as_posix()] = path.stat().st_size
    return out


def crc32(path: Path) -> str:
    """The file's CRC32 as 8 hex digits (read in 8 MiB chunks: memory stays flat)."""
    crc = 0
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := fh.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def shares(sizes: dict[str, int], n: int) -> list[list[str]]:
    """``sizes``' files split into ``n`` lists of about equal bytes (largest first, each to the
    lightest list): rank r hashes ``shares(...)[r]``. The same input gives every rank the same split."""
    out: list[list[str]] = [[] for _ in range(n)]
    load = [0] * n
    for name, size in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        r = load.index(min(load))
        out[r].append(name)
        load[r] += size
    return out


def checksums(directory: Path, names: Iterable[str]) -> dict[str, str]:
    return {name: crc32(directory / name) for name in names}


def write(directory: Path, sizes: dict[str, int], sums: dict[str, str] | None) -> None:
    """Writes ``directory/manifest.json`` durably. ``sums`` (CRC32 per file) may be None: the
    manifest then proves sizes only."""
    files: dict[str, Any] = {
        name: {"size": size, **({ALGORITHM: sums[name]} if sums is not None else {})} for name, size in sizes.items()
    }
    record = {"format": FORMAT, "algorithm": ALGORITHM if sums is not None else None, "files": files}
    path = directory / MANIFEST
    # fsync: the rename that publishes the checkpoint must never reach the disk before the
    # manifest does (a host crash would leave a checkpoint that proves nothing).
    with open(path, "w") as fh:
        json.dump(record, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())


def write_for(directory: Path, *, with_checksums: bool = True) -> None:
    """The manifest of ``directory`` as it is, computed by one process (tests, tools)."""
    sizes = file_sizes(directory)
    write(directory, sizes, checksums(directory, sizes) if with_checksums else None)


class ManifestError(ValueError):
    """``directory``'s manifest is missing or unreadable; the message says which."""


def read(directory: Path) -> dict[str, dict[str, Any]]:
    """The manifest's files (name -> {"size", "crc32"}); raises ManifestError."""
    path = directory / MANIFEST
    if not path.is_file():
        raise ManifestError(f"no {MANIFEST} (a save that never finished, or one made before checkpoints had one)")
    try:
        record = json.loads(path.read_text())
        files = record["files"]
        if record.get("format") != FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {record.get('format')!r}, this learner reads {FORMAT}")
        for name, entry in files.items():
            if not (isinstance(entry, dict) and isinstance(entry.get("size"), int)):
                raise ValueError(f"the entry of {name} is {entry!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ManifestError(f"{MANIFEST} is unreadable ({type(e).__name__}: {e})") from None
    return files


def problem(directory: Path, name: str, entry: dict[str, Any], *, checksum: bool) -> str | None:
    """What is wrong with file ``name`` against its manifest ``entry`` (None: nothing)."""
    path = directory / name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as e:
        return f"{name} cannot be read ({e})"
    if size != entry.get("size"):
        return f"{name} has {size} bytes, the manifest says {entry.get('size')}"
    if checksum and ALGORITHM in entry:
        try:
            got = crc32(path)
        except OSError as e:
            return f"{name} cannot be read ({e})"
        if got != entry[ALGORITHM]:
            return f"{name} fails its checksum ({ALGORITHM} {got}, the manifest says {entry[ALGORITHM]})"
    return None
