"""Checked reads out of a checkpoint's files: ``_Reader`` validates the manifest's records, CRC-checks each
piece a load needs and reads flat ranges with ``pread`` (nothing memory-mapped: a file cut short or a read
error is a CheckpointError naming the file, not a SIGBUS). Format 1's ``.npy`` files are read the same way
after their header."""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from paramplane.checkpoint.files import _CHUNK, CheckpointError
from paramplane.node.arrays import DTYPES, array_module, dtype_name
from paramplane.parallel.sharding import ShardedArray


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
