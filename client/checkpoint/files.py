"""The files of a checkpoint directory: durable writes, file names, per-rank failure reports, and the reader
that checks and copies flat ranges out of them (``api`` holds the protocol)."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from paramplane.node.arrays import DTYPES, array_module
from paramplane.parallel.sharding import ShardedArray


class CheckpointError(ValueError):
    """A checkpoint that does not fit the state it is loaded into, is damaged, or state that cannot be saved."""


class SaveFailed(CheckpointError):
    """Another rank's part of a save failed (its error is in the message); nothing was committed."""


def _storage(a: np.ndarray) -> np.ndarray:
    """``a`` as ``np.save`` can write it: dtypes numpy does not know (bfloat16) as same-size unsigned ints."""
    return a if a.dtype.kind in "biufc" else a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _file_name(key: str, start: int, stop: int) -> str:
    """A file name for a piece: the key made safe, plus a hash of the exact key (keys that make the same
    safe text, such as "lr sched" and "lr_sched", get different names)."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in key.replace("/", "__"))[:120]
    digest = hashlib.blake2s(key.encode(), digest_size=4).hexdigest()
    return f"{safe}.{digest}.{start}-{stop}.npy"


def _write_npys(pieces: list[tuple[Path, np.ndarray]]) -> None:
    """Each ``(path, array)`` durably: every array is written under a temporary name first, then each file is
    fsynced and renamed into place (the writes' writeback overlaps instead of waiting file by file)."""
    staged = []
    for path, a in pieces:
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, _storage(a), allow_pickle=False)
        staged.append((tmp, path))
    for tmp, path in staged:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)


def _crc(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _report_failure(target: Path, rank: int, save_id: str, exc: BaseException) -> None:
    """Leave ``.rank-<r>.error`` for the other ranks' waits (best effort: the disk may be what failed)."""
    path = target / f".rank-{rank}.error"
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_text(
            json.dumps({"save_id": save_id, "rank": rank, "error": f"{type(exc).__name__}: {exc}"})
        )
        os.replace(tmp, path)
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


class _Reader:
    """Opens each file once, checks its CRC32, and copies flat ranges out of it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._open: dict[str, np.ndarray] = {}

    def array(self, rec: dict[str, Any], dtype: str) -> np.ndarray:
        """The file of piece ``rec`` (checked) as an array of the manifest's ``dtype``."""
        name = rec["file"]
        if name not in self._open:
            try:
                arr = np.load(self.root / name, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{self.root / name} cannot be read: {exc}") from None
            if _crc(arr) != rec["crc32"]:
                raise CheckpointError(
                    f"{self.root / name} is corrupted: its CRC32 does not match the manifest"
                )
            want = DTYPES[dtype]
            if arr.dtype != want:  # bfloat16 and the like are stored as same-size unsigned ints
                if arr.dtype.kind not in "uV" or arr.dtype.itemsize != want.itemsize:
                    raise CheckpointError(f"{self.root / name} holds {arr.dtype}, the manifest says {dtype}")
                arr = arr.view(want)
            if arr.ndim != 1 or arr.size != rec["stop"] - rec["start"]:
                raise CheckpointError(
                    f"{self.root / name} holds {arr.shape}, the manifest says {rec['stop'] - rec['start']} elements"
                )
            self._open[name] = arr
        return self._open[name]

    def check(self, key: str, entry: dict[str, Any], start: int, stop: int) -> str | None:
        """Open (and CRC-check) every file holding elements ``[start, stop)`` of ``key``; the problem, if any."""
        covered = 0
        try:
            for rec in entry["pieces"]:
                lo, hi = max(rec["start"], start), min(rec["stop"], stop)
                if hi > lo:
                    self.array(rec, entry["dtype"])
                    covered += hi - lo
        except CheckpointError as exc:
            return str(exc)
        if covered != stop - start:
            return f"{key!r}: the checkpoint holds {covered} of the {stop - start} elements this rank needs"
        return None

    def fill(self, key: str, entry: dict[str, Any], target: ShardedArray) -> None:
        problem = self.check(key, entry, target.start, target.stop)
        if problem is not None:
            raise CheckpointError(problem)
        for rec in entry["pieces"]:
            lo, hi = max(rec["start"], target.start), min(rec["stop"], target.stop)
            if hi > lo:
                src = self.array(rec, entry["dtype"])[lo - rec["start"] : hi - rec["start"]]
                dst = target.local[lo - target.start : hi - target.start]
                dst[...] = array_module(dst).asarray(src)
