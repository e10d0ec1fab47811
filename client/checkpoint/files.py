"""The files of a checkpoint directory: durable writes, file names, per-rank failure reports, and the reader
that checks and copies flat ranges out of them (``api`` holds the protocol).

A save writes one data file per rank (``rank-<r>.data``): the rank's pieces back to back as raw bytes, each
starting at a multiple of ``ALIGN`` bytes; the manifest's record of a piece names the file, the byte
``offset`` and the CRC32 of the piece's bytes, and its dtype is the array's. Checkpoints written before
(manifest format 1) hold one ``.npy`` file per piece, records without ``offset``: they still load."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import uuid
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from paramplane.node.arrays import DTYPES, array_module
from paramplane.parallel.sharding import ShardedArray

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


def _write_data_file(path: Path, arrays: Sequence[np.ndarray]) -> list[tuple[int, int]]:
    """``arrays`` back to back in one file at ``path`` (raw bytes, each starting at a multiple of ``ALIGN``),
    durably: written under a temporary name, fsynced once and renamed into place. Each array's byte offset
    and CRC32. The disk writes each chunk while the next is checksummed and written, so the fsync at the
    end waits for little more than the last chunks."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
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
    (``.rank-*``), data files, and temporaries not yet renamed (``.*.tmp``)."""
    for pattern in (".rank-*", "rank-*.data", ".*.tmp"):
        for leftover in target.glob(pattern):
            leftover.unlink(missing_ok=True)


def _crc(a: np.ndarray) -> int:
    return zlib.crc32(_raw(a).data)


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
    """Opens each file once (data files memory-mapped), checks each piece's CRC32 once, and copies flat
    ranges out of them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._files: dict[str, np.ndarray] = {}  # data files, whole, as uint8 over an mmap
        self._open: dict[tuple[str, int | None], np.ndarray] = {}  # checked pieces by (file, offset)

    def _path(self, name: Any) -> Path:
        if not isinstance(name, str) or not name or name != Path(name).name or name in (".", ".."):
            raise CheckpointError(f"{self.root}: the manifest names {name!r}, not a file of the checkpoint")
        return self.root / name

    def array(self, rec: dict[str, Any], dtype: str, key: str = "") -> np.ndarray:
        """Piece ``rec`` (checked) as a flat array of the manifest's ``dtype``."""
        slot = (rec["file"], rec.get("offset"))
        if slot not in self._open:
            what = f"{key!r}[{rec['start']}:{rec['stop']}]" if key else f"[{rec['start']}:{rec['stop']}]"
            if "offset" in rec:
                self._open[slot] = self._piece(rec, DTYPES[dtype], what)
            else:
                self._open[slot] = self._npy(rec, dtype)
        return self._open[slot]

    def _data(self, name: str) -> np.ndarray:
        """Data file ``name`` as uint8, memory-mapped, opened once."""
        if name not in self._files:
            path = self._path(name)
            try:
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    buf: Any = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{path} cannot be read: {exc}") from None
            self._files[name] = np.frombuffer(buf, np.uint8)
        return self._files[name]

    def _piece(self, rec: dict[str, Any], dtype: np.dtype[Any], what: str) -> np.ndarray:
        """A piece of a data file: its ``stop - start`` elements from byte ``offset`` on, CRC-checked."""
        path, offset = self._path(rec["file"]), rec["offset"]
        nbytes = (rec["stop"] - rec["start"]) * dtype.itemsize
        if not isinstance(offset, int) or offset < 0 or nbytes < 0:
            raise CheckpointError(f"{path}: the manifest's record of {what} is invalid: {rec}")
        data = self._data(rec["file"])
        if offset + nbytes > data.size:
            raise CheckpointError(
                f"{path} is truncated or damaged: {what} needs bytes {offset} to {offset + nbytes}, "
                f"the file holds {data.size}"
            )
        raw = data[offset : offset + nbytes]
        if _crc(raw) != rec["crc32"]:
            raise CheckpointError(
                f"{path} is corrupted: the CRC32 of {what} (bytes {offset} to {offset + nbytes}) "
                "does not match the manifest"
            )
        return raw.view(dtype)

    def _npy(self, rec: dict[str, Any], dtype: str) -> np.ndarray:
        """A piece in a ``.npy`` file of its own (checkpoints of format 1)."""
        path = self._path(rec["file"])
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path} cannot be read: {exc}") from None
        if _crc(arr) != rec["crc32"]:
            raise CheckpointError(f"{path} is corrupted: its CRC32 does not match the manifest")
        want = DTYPES[dtype]
        if arr.dtype != want:  # bfloat16 and the like were stored as same-size unsigned ints
            if arr.dtype.kind not in "uV" or arr.dtype.itemsize != want.itemsize:
                raise CheckpointError(f"{path} holds {arr.dtype}, the manifest says {dtype}")
            arr = arr.view(want)
        if arr.ndim != 1 or arr.size != rec["stop"] - rec["start"]:
            raise CheckpointError(
                f"{path} holds {arr.shape}, the manifest says {rec['stop'] - rec['start']} elements"
            )
        return arr

    def check(self, key: str, entry: dict[str, Any], start: int, stop: int) -> str | None:
        """Open (and CRC-check) every piece holding elements ``[start, stop)`` of ``key``; the problem, if any."""
        covered = 0
        try:
            for rec in entry["pieces"]:
                lo, hi = max(rec["start"], start), min(rec["stop"], stop)
                if hi > lo:
                    self.array(rec, entry["dtype"], key)
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
                src = self.array(rec, entry["dtype"], key)[lo - rec["start"] : hi - rec["start"]]
                dst = target.local[lo - target.start : hi - target.start]
                dst[...] = array_module(dst).asarray(src)
