"""The files of a checkpoint directory: durable writes, file names, per-rank failure reports, and the
verdict that settles a failed save against its commit (``commit`` holds the protocol; ``reader`` checks and
reads flat ranges out of the files with ``pread``).

A save writes one data file per rank (``rank-<r>.data``): the rank's pieces back to back as raw bytes, each
starting at a multiple of ``ALIGN`` bytes; the manifest's record of a piece names the file, the byte
``offset`` and the CRC32 of the piece's bytes, and its dtype is the array's. Checkpoints written before
(manifest format 1) hold one ``.npy`` file per piece, records without ``offset``: they still load."""

from __future__ import annotations

import ctypes
import json
import os
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ALIGN = 64  # every piece of a data file starts at a multiple of this many bytes


class CheckpointError(ValueError):
    """A checkpoint that does not fit the state it is loaded into, is damaged, or state that cannot be saved."""


class SaveFailed(CheckpointError):
    """Another rank's part of a save failed (its error is in the message); nothing was committed."""


def _data_file_name(rank: int) -> str:
    """The one data file group rank ``rank`` writes in a save."""
    return f"rank-{rank}.data"


def _raw(a: np.ndarray) -> np.ndarray:
    """The bytes of ``a`` (any dtype, bfloat16 included) as a flat uint8 view, or a copy if ``a`` is strided."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _writeback_starter() -> Callable[[int, int, int], object]:
    """``start(fd, offset, nbytes)``: Linux's ``sync_file_range(..., SYNC_FILE_RANGE_WRITE)``, which starts
    writing those pages to disk without waiting (durability still comes from the fsync); elsewhere a no-op."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError, TypeError):
        return lambda fd, offset, nbytes: None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return lambda fd, offset, nbytes: fn(fd, offset, nbytes, 2)  # 2: SYNC_FILE_RANGE_WRITE


_start_writeback = _writeback_starter()
_CHUNK = 4 << 20  # bytes written (then their writeback started, then checksummed) at a time


def _tmp_path(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place (a crashed attempt's are ``.*.tmp``)."""
    name = path.name if path.name.startswith(".") else f".{path.name}"
    return path.with_name(f"{name}.{uuid.uuid4().hex[:8]}.tmp")


def _put_text(path: Path, text: str) -> None:
    """``text`` at ``path`` all at once for a reader (written aside, then renamed; not fsynced)."""
    tmp = _tmp_path(path)
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_data_file(path: Path, arrays: Sequence[np.ndarray]) -> list[tuple[int, int]]:
    """``arrays`` back to back in one file at ``path`` (raw bytes, each starting at a multiple of ``ALIGN``),
    durably: written under a temporary name, fsynced once and renamed into place. Each array's byte offset
    and CRC32. The disk writes each chunk while the next is checksummed and written, so the fsync at the
    end waits for little more than the last chunks."""
    tmp = _tmp_path(path)
    placed, pos = [], 0
    try:
        with open(tmp, "wb", buffering=0) as f:
            fd = f.fileno()
            for a in arrays:
                pad = -pos % ALIGN
                if pad:
                    _write_all(f, memoryview(bytes(pad)))
                    pos += pad
                offset, crc, raw = pos, 0, _raw(a).data
                for lo in range(0, raw.nbytes, _CHUNK):
                    chunk = raw[lo : lo + _CHUNK]
                    _write_all(f, chunk)
                    _start_writeback(fd, pos, chunk.nbytes)
                    crc = zlib.crc32(chunk, crc)
                    pos += chunk.nbytes
                placed.append((offset, crc))
            os.fsync(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk gets its space back
        raise
    return placed


def _write_all(f: Any, data: memoryview) -> None:
    """All of ``data`` to the unbuffered file ``f`` (a write may take less than it is given)."""
    while data.nbytes:
        data = data[f.write(data) :]


def _remove_leftovers(target: Path) -> None:
    """What a crashed attempt at this save may have left in ``target``: per-rank lists and error reports
    (``.rank-*``), data files, verdicts (``.verdict-*``) and temporaries not yet renamed (``.*.tmp``)."""
    for pattern in (".rank-*", "rank-*.data", ".verdict-*", ".*.tmp"):
        for leftover in target.glob(pattern):
            leftover.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj: Any) -> None:
    tmp = _tmp_path(path)
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _report_failure(target: Path, rank: int, save_id: str, exc: BaseException) -> None:
    """Leave ``.rank-<r>.error`` for the other ranks' waits (best effort: the disk may be what failed)."""
    report = {"save_id": save_id, "rank": rank, "error": f"{type(exc).__name__}: {exc}"}
    try:
        _put_text(target / f".rank-{rank}.error", json.dumps(report))
    except OSError:
        pass


def _check_failures(target: Path, save_id: str) -> None:
    """Raise SaveFailed when a rank of this save left an error file."""
    for path in target.glob(".rank-*.error"):
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(report, dict) and report.get("save_id") == save_id:
            raise SaveFailed(
                f"saving {target} failed on group rank {report.get('rank')}: {report.get('error')}"
            )


def _verdict_path(target: Path, save_id: str) -> Path:
    return target / f".verdict-{save_id}"


def _decide(target: Path, save_id: str, verdict: str) -> str:
    """Record ``verdict`` for save ``save_id`` unless one is recorded already, and return the one that holds:
    "commit" (group rank 0, about to write the manifest) or "abort" (a rank that gave the save up, before it
    removes its data file). The record is an exclusive create, so of a rank giving up and rank 0 committing
    exactly one wins: no rank removes a file a committed manifest names. "unknown" when the record cannot be
    read (treat as "commit": keep the files). OSError when it cannot be created."""
    path = _verdict_path(target, save_id)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        deadline = time.monotonic() + 1.0
        while True:  # the winner writes its verdict right after creating the file
            try:
                found = path.read_text()
            except FileNotFoundError:
                return "commit"  # only rank 0 removes it, once the manifest is in place
            except OSError:
                return "unknown"
            if found in ("commit", "abort"):
                return found
            if time.monotonic() > deadline:
                return "unknown"
            time.sleep(0.01)
    try:
        os.write(fd, verdict.encode())
    finally:
        os.close(fd)
    return verdict


def _overrule(target: Path, save_id: str) -> None:
    """Group rank 0 decided to commit save ``save_id`` but failed before the manifest was in place: the
    verdict becomes "abort", so that the ranks giving up remove their data files."""
    _put_text(_verdict_path(target, save_id), "abort")
