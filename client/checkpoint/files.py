"""The files of a checkpoint directory: durable writes, file names, per-rank failure reports, the verdict
that settles a failed save against its commit, and the reader that checks and reads flat ranges out of them
with ``pread`` (``commit`` holds the protocol, ``load`` the validation).

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

from paramplane.node.arrays import DTYPES, array_module, dtype_name
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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_into(fd: int, buf: np.ndarray, pos: int) -> int:
    """Up to ``buf.nbytes`` bytes of ``fd`` from byte ``pos`` into the uint8 array ``buf``; how many (0 at
    the end of the file). A plain read: no memory map, so a file cut short is a short read, not a SIGBUS."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [buf.data], pos)
    data = os.pread(fd, buf.nbytes, pos)
    buf[: len(data)] = np.frombuffer(data, np.uint8)
    return len(data)


_MAX_READ = 1 << 30  # bytes asked of one read (Linux returns at most about 2 GiB at a time anyway)


class _Reader:
    """Reads pieces out of a checkpoint's files with ``pread``: nothing is memory-mapped, so a file cut short
    or a read error while loading is a CheckpointError naming the file (not a SIGBUS). ``check`` validates
    a key's records and CRC-checks each piece a range needs, once, reading it in chunks into one reused
    buffer (only the fact that it was checked is kept, not its bytes); ``fill`` then reads just the byte
    range a target needs, straight into it when it is a contiguous host array of the manifest's dtype.
    Each file is opened once; ``close()`` (or leaving a ``with`` block) closes them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._fds: dict[str, tuple[int, int]] = {}  # file name -> (fd, size when opened)
        self._headers: dict[str, int] = {}  # .npy files (format 1) -> byte offset of their data
        # (file, offset, nbytes, crc32) of the pieces checked: the fact, not their bytes
        self._checked: set[tuple[str, int, int, int]] = set()
        self._chunk: np.ndarray | None = None  # the buffer pieces are checked through

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # a reader nobody closed (consolidate): its files are closed all the same
        try:
            self.close()
        except Exception:
            pass

    def close(self) -> None:
        """Close every file this reader opened."""
        while self._fds:
            fd, _ = self._fds.popitem()[1]
            os.close(fd)

    def _path(self, name: Any) -> Path:
        if not isinstance(name, str) or not name or name != Path(name).name or name in (".", ".."):
            raise CheckpointError(f"{self.root}: the manifest names {name!r}, not a file of the checkpoint")
        return self.root / name

    def _open(self, name: str) -> tuple[int, int]:
        """The fd of file ``name`` (opened once) and its size when opened."""
        if name not in self._fds:
            path = self._path(name)
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise CheckpointError(f"{path} cannot be read: {exc}") from None
            try:
                size = os.fstat(fd).st_size
            except OSError as exc:
                os.close(fd)
                raise CheckpointError(f"{path} cannot be read: {exc}") from None
            self._fds[name] = (fd, size)
        return self._fds[name]

    def _read(self, name: str, buf: np.ndarray, pos: int, what: str) -> None:
        """Bytes ``pos`` to ``pos + buf.nbytes`` of file ``name`` into the uint8 array ``buf``; a short read
        (the file was cut short) or a read error is a CheckpointError naming the file."""
        fd, _ = self._open(name)
        done, total = 0, buf.nbytes
        while done < total:
            try:
                n = _read_into(fd, buf[done : done + _MAX_READ], pos + done)
            except (OSError, OverflowError) as exc:
                raise CheckpointError(f"{self._path(name)} cannot be read: {exc}") from None
            if n <= 0:
                raise CheckpointError(
                    f"{self._path(name)} is truncated or damaged: {what} needs bytes {pos} to {pos + total}, "
                    f"reading it ended at byte {pos + done}"
                )
            done += n

    def _record(self, rec: Any, key: str) -> None:
        """CheckpointError unless ``rec`` is a well-formed record of a piece (a damaged manifest can be valid
        JSON with a float ``stop`` or without a ``crc32``)."""
        if not isinstance(rec, dict):
            raise CheckpointError(f"{self.root}: the manifest's entry of {key!r} lists {rec!r}, not a piece")
        fields = ("start", "stop", "crc32", *(("offset",) if "offset" in rec else ()))
        missing = [f for f in fields if f not in rec]
        wrong = [f"{f}={rec[f]!r}" for f in fields if f in rec and not _is_int(rec[f])]
        if missing:
            reason: str | None = f"no {', '.join(missing)}"
        elif wrong:
            reason = f"{', '.join(wrong)}: not an integer"
        elif not 0 <= rec["start"] <= rec["stop"]:
            reason = f"start {rec['start']}, stop {rec['stop']}"
        elif rec.get("offset", 0) < 0:
            reason = f"offset {rec['offset']}"
        elif not isinstance(rec.get("file"), str):
            reason = f"file={rec.get('file')!r}: not a file name"
        else:
            reason = None
        if reason is not None:
            raise CheckpointError(
                f"{self.root}: the manifest's record of a piece of {key!r} is invalid ({reason}): {rec}"
            )
        self._path(rec.get("file"))

    def _place(self, rec: dict[str, Any], dtype: np.dtype[Any]) -> tuple[int, int]:
        """Where piece ``rec`` (validated) lies in its file: byte offset and length."""
        nbytes = (rec["stop"] - rec["start"]) * dtype.itemsize
        if "offset" in rec:
            return rec["offset"], nbytes
        return self._npy(rec, dtype), nbytes

    def _npy(self, rec: dict[str, Any], dtype: np.dtype[Any]) -> int:
        """The byte offset of the data of a ``.npy`` file holding one piece (checkpoints of format 1), after
        checking its header against the record: read with ``pread`` like the data files, not memory-mapped."""
        name = rec["file"]
        if name not in self._headers:
            path = self._path(name)
            fd, _ = self._open(name)
            try:
                with os.fdopen(os.dup(fd), "rb") as f:
                    version = np.lib.format.read_magic(f)
                    if version not in ((1, 0), (2, 0)):
                        raise ValueError(f".npy format version {version} is not one np.save writes here")
                    read = (
                        np.lib.format.read_array_header_1_0
                        if version == (1, 0)
                        else np.lib.format.read_array_header_2_0
                    )
                    shape, _, stored = read(f)
                    self._headers[name] = f.tell()
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{path} cannot be read: {exc}") from None
            # bfloat16 and the like were stored as same-size unsigned ints
            if stored != dtype and (stored.kind not in "uV" or stored.itemsize != dtype.itemsize):
                raise CheckpointError(f"{path} holds {stored}, the manifest says {dtype_name(dtype)}")
            if len(shape) != 1 or shape[0] != rec["stop"] - rec["start"]:
                raise CheckpointError(
                    f"{path} holds {shape}, the manifest says {rec['stop'] - rec['start']} elements"
                )
        return self._headers[name]

    def _verify(self, rec: dict[str, Any], dtype: np.dtype[Any], what: str) -> None:
        """CRC-check piece ``rec`` once, reading it in chunks (its bytes are not kept)."""
        name = rec["file"]
        offset, nbytes = self._place(rec, dtype)
        slot = (name, offset, nbytes, rec["crc32"])
        if slot in self._checked:
            return
        path, (_, size) = self._path(name), self._open(name)
        if offset + nbytes > size:
            raise CheckpointError(
                f"{path} is truncated or damaged: {what} needs bytes {offset} to {offset + nbytes}, "
                f"the file holds {size}"
            )
        if self._chunk is None:
            self._chunk = np.empty(_CHUNK, np.uint8)
        crc = 0
        for lo in range(0, nbytes, _CHUNK):
            chunk = self._chunk[: min(_CHUNK, nbytes - lo)]
            self._read(name, chunk, offset + lo, what)
            crc = zlib.crc32(chunk.data, crc)
        if crc != rec["crc32"]:
            raise CheckpointError(
                f"{path} is corrupted: the CRC32 of {what} (bytes {offset} to {offset + nbytes}) "
                "does not match the manifest"
            )
        self._checked.add(slot)

    def check(self, key: str, entry: dict[str, Any], start: int, stop: int) -> str | None:
        """Validate every record of ``key`` and CRC-check every piece holding elements ``[start, stop)``;
        the problem, if any. Every rank checking ``key`` finds the same problem with its records."""
        covered = 0
        try:
            pieces = entry.get("pieces") if isinstance(entry, dict) else None
            named = entry.get("dtype") if isinstance(entry, dict) else None
            if not isinstance(pieces, list) or not isinstance(named, str) or named not in DTYPES:
                raise CheckpointError(f"{self.root}: the manifest's entry of {key!r} is invalid: {entry}")
            for rec in pieces:
                self._record(rec, key)
            dtype = DTYPES[named]
            for rec in pieces:
                lo, hi = max(rec["start"], start), min(rec["stop"], stop)
                if hi > lo:
                    self._verify(rec, dtype, _what(key, rec))
                    covered += hi - lo
        except CheckpointError as exc:
            return str(exc)
        if covered != stop - start:
            return f"{key!r}: the checkpoint holds {covered} of the {stop - start} elements this rank needs"
        return None

    def fill(self, key: str, entry: dict[str, Any], target: ShardedArray) -> None:
        """Copy ``target``'s range of ``key`` in (checked first, if ``check`` was not called): each piece's
        part read straight into ``target.local`` when it is a contiguous writable numpy array of the manifest's
        dtype, else through a bounded host buffer (cupy targets)."""
        problem = self.check(key, entry, target.start, target.stop)
        if problem is not None:
            raise CheckpointError(problem)
        dtype = DTYPES[entry["dtype"]]
        size = dtype.itemsize
        for rec in entry["pieces"]:
            lo, hi = max(rec["start"], target.start), min(rec["stop"], target.stop)
            if hi <= lo:
                continue
            offset, _ = self._place(rec, dtype)
            name, what = rec["file"], _what(key, rec)
            dst = target.local[lo - target.start : hi - target.start]
            if (
                isinstance(dst, np.ndarray)
                and dst.dtype == dtype
                and dst.flags.c_contiguous
                and dst.flags.writeable
            ):
                self._read(name, dst.view(np.uint8), offset + (lo - rec["start"]) * size, what)
                continue
            step = max(1, _FILL_BUFFER // size)
            buf = np.empty(min(step, hi - lo), dtype)
            xp = array_module(dst)
            for a in range(lo, hi, step):
                part = buf[: min(step, hi - a)]
                self._read(name, part.view(np.uint8), offset + (a - rec["start"]) * size, what)
                dst[a - lo : a - lo + part.size] = xp.asarray(part)


_FILL_BUFFER = 64 << 20  # bytes of a piece read at a time into a target that cannot be read into directly


def _what(key: str, rec: dict[str, Any]) -> str:
    return f"{key!r}[{rec['start']}:{rec['stop']}]" if key else f"[{rec['start']}:{rec['stop']}]"
