"""Shared-memory collectives for CPU ranks of one host.

One segment per group: a control area (per rank: a phase counter, its pid and
its current op's spec, double-buffered by op parity) and two banks of one data
slot per rank, used alternately by successive rounds so that one barrier per
round suffices where a round's readers finish before the bank is reused.
Ranks wait on the phase counters, spinning briefly and then backing off, and
notice a dead peer by its liveness lock. The segment file is unlinked by every rank as soon as they
have all mapped it (or the setup failed), so a crash after that leaves nothing in /dev/shm; a segment
whose creator was killed during the setup, before any other rank could unlink it, is removed by the next
group setup on the host (``sweep_stale_segments``: nobody holds its locks).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from paramplane.node.errors import CollectiveMismatch, CollectiveTimeout, PeerLost, PlaneError
from paramplane.node.spec import OpSpec, reduce_ufunc, split_bounds
from paramplane.node.transports.base import Splits, Transport

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "paramplane-"
CTRL_STRIDE = 1024  # bytes of control area per rank
SPEC_OFFSET = 64  # spec texts start here within a rank's control area
SPEC_BYTES = 448  # per parity
DEFAULT_SLOT_BYTES = 1 << 20  # measured best of 0.5-8 MiB for 64 MiB all-reduces (cache-sized rounds)


def slot_bytes(mb: float) -> int:
    """The slot size in bytes for ``mb`` MiB (PARAMPLANE_SHM_SLOT_MB): at least 4 KiB, 64-byte aligned."""
    if mb <= 0:
        raise ValueError(f"the shm slot size must be positive, got {mb} MiB (PARAMPLANE_SHM_SLOT_MB)")
    return max(4096, int(mb * (1 << 20)) // 64 * 64)


def segment_size(num_ranks: int, slot_bytes: int) -> int:
    return num_ranks * CTRL_STRIDE + 2 * num_ranks * slot_bytes


class Segment:
    """A mapped segment and its open file, which stays open: each rank holds a lock on one byte of it."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.mm = mmap.mmap(fd, size)

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            pass
        if self.fd >= 0:
            os.close(self.fd)  # releases this process's liveness lock
            self.fd = -1


def create_segment(name: str, size: int) -> Segment:
    """Create and map /dev/shm/``name`` (which must not exist)."""
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    _mine.add(name)
    try:
        os.ftruncate(fd, size)
        return Segment(fd, size)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise


def open_segment(name: str, size: int) -> Segment:
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    _mine.add(name)
    try:
        if os.fstat(fd).st_size != size:
            raise PlaneError(f"shm segment {name} has the wrong size (another job's?)")
        return Segment(fd, size)
    except BaseException:
        os.close(fd)
        raise


STALE_AGE_S = 60.0
_mine: set[str] = set()  # segments this process created or opened (its own locks do not conflict with it)


def sweep_stale_segments() -> list[str]:
    """Unlink paramplane segments in /dev/shm that no live process holds; returns their names.

    A rank killed while its group's segment was being set up (before every rank had mapped it) leaves
    the file behind. Every rank holds a lock on its segment while it lives, so one that nobody locks is
    stale; files younger than ``STALE_AGE_S`` are left alone (a segment being created is not locked yet),
    as are this process's own and files it may not open (another user's).
    """
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(SEGMENT_PREFIX) or name in _mine:
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            if time.time() - os.fstat(fd).st_mtime < STALE_AGE_S:
                continue
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 0, 0)  # the whole file: no rank holds a byte
            except OSError:
                continue
            os.unlink(path)
            removed.append(name)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


def unlink_segment(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


class ShmComm:
    """Collectives of one group over a mapped segment; ops run in the calling thread (a ``Comm``)."""

    name: Transport = "shm"
    device = False

    def __init__(
        self,
        segment: Segment,
        ranks: Sequence[int],
        index: int,
        slot_bytes: int,
        aborted: threading.Event,
        abort_reason: Any,
    ) -> None:
        self.segment = segment
        mm = self.mm = segment.mm
        self.ranks = list(ranks)
        self.n = len(self.ranks)
        self.index = index
        self.slot_bytes = slot_bytes
        self._aborted = aborted
        self._abort_reason = abort_reason
        self._ctrl = np.ndarray((self.n, CTRL_STRIDE // 8), np.int64, buffer=mm)
        self._ctrl_bytes = np.ndarray((self.n, CTRL_STRIDE), np.uint8, buffer=mm)
        data_off = self.n * CTRL_STRIDE
        self._data = np.ndarray((2, self.n, slot_bytes), np.uint8, buffer=mm, offset=data_off)
        self._phase = int(self._ctrl[index, 0])
        self._bank = 0
        self._num_ops = 0
        self._parity = 0
        self.failure: PlaneError | None = None
        self._ctrl[index, 1] = os.getpid()
        # Liveness: every rank holds an exclusive lock on byte ``index`` of the segment's file. The kernel
        # drops it when the process exits (a zombie holds none), and it means the same thing in every PID
        # namespace, which a pid does not.
        fcntl.lockf(segment.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, index)
        # Phase counters read as plain ints (cheaper than numpy indexing in the wait loop).
        self._counters = memoryview(mm).cast("q")
        self._stride = CTRL_STRIDE // 8
        self._others = [j * self._stride for j in range(self.n) if j != index]
        # Spinning only pays while every rank has a core; oversubscribed ranks yield at once.
        self._spin_s = 0.0002 if self.n <= (os.cpu_count() or 1) else 0.0
        self._data[:, index, :] = 0  # fault our pages in now, not in the first collective

    def abort(self) -> None:
        return None  # peers watch each other's liveness locks and the world's abort flag

    def close(self) -> None:
        if self.mm.closed:
            return
        self._counters.release()
        del self._ctrl, self._ctrl_bytes, self._data
        self.segment.close()

    # -- synchronisation -------------------------------------------------------------------------
    def _sync(self, deadline: float) -> None:
        """Publish the next phase and wait until every rank has published it.

        Spins briefly (a peer in step arrives within microseconds), then yields the core for half a
        millisecond, then sleeps in growing steps so that a slow peer costs no CPU (benchmarks/torch_models.py:
        yielding for 5 ms cost pp.DDP 7% of its step at world 2, against the backward of the rank beside it).
        """
        self._phase += 1
        phase = self._phase
        counters = self._counters
        counters[self.index * self._stride] = phase
        others = self._others
        if all(counters[k] >= phase for k in others):
            return
        start = time.monotonic()
        next_check = start + 0.02
        while True:
            for _ in range(64):
                if all(counters[k] >= phase for k in others):
                    return
            now = time.monotonic()
            waited = now - start
            if waited > self._spin_s:
                # Past a short pure spin: yield the core for half a millisecond, then sleep in growing steps. A rank
                # computing beside this wait (a DDP bucket waits for the slowest rank's backward) gets the core.
                time.sleep(0 if waited < 0.0005 else min(0.001, waited / 50))
            if now >= next_check:
                next_check = now + 0.02
                self._check(phase, now, deadline)

    def _check(self, phase: int, now: float, deadline: float) -> None:
        if self._aborted.is_set():
            raise self._fail(self._abort_reason())
        lagging = [j for j in range(self.n) if int(self._ctrl[j, 0]) < phase]
        for j in lagging:
            if not self._alive(j):
                pid = int(self._ctrl[j, 1])
                raise self._fail(
                    PeerLost(
                        f"rank {self.ranks[j]} (pid {pid} in its namespace) died during a shared-memory collective",
                        self.ranks[j],
                    )
                )
        if now >= deadline:
            names = [self.ranks[j] for j in lagging]
            raise self._fail(
                CollectiveTimeout(
                    f"shared-memory collective timed out waiting for ranks {names}; raise the group timeout "
                    "(PARAMPLANE_TIMEOUT) if they are merely slow, else check them for a hang"
                )
            )

    def _alive(self, j: int) -> bool:
        """Whether the rank at index ``j`` still holds its lock (see ``__init__``)."""
        try:
            fcntl.lockf(self.segment.fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, j)
        except OSError:
            return True  # held by its live process
        fcntl.lockf(self.segment.fd, fcntl.LOCK_UN, 1, j)
        return False

    def _fail(self, exc: PlaneError) -> PlaneError:
        self.failure = self.failure or exc
        return self.failure

    def _begin(self, spec: OpSpec) -> None:
        if self.failure is not None:
            raise self.failure
        # Spec areas alternate per op on this segment (not per seq: one group op may run several).
        self._parity = self._num_ops % 2
        self._num_ops += 1
        text = f"{spec.seq}|{spec.op}|{spec.dtype}|{','.join(map(str, spec.shape))}|{spec.arg}".encode()[
            :SPEC_BYTES
        ]
        off = SPEC_OFFSET + self._parity * SPEC_BYTES
        row = self._ctrl_bytes[self.index]
        row[off : off + SPEC_BYTES] = 0
        row[off : off + len(text)] = np.frombuffer(text, np.uint8)

    def _check_specs(self, spec: OpSpec) -> None:
        off = SPEC_OFFSET + self._parity * SPEC_BYTES
        texts = [
            bytes(self._ctrl_bytes[j, off : off + SPEC_BYTES]).rstrip(b"\0").decode() for j in range(self.n)
        ]
        if len(set(texts)) == 1:
            return
        parts = []
        for j, t in enumerate(texts):
            seq, op, dtype, shape, arg = (t.split("|") + [""] * 5)[:5]
            dims = tuple(int(d) for d in shape.split(",") if d)
            parts.append(
                f"rank {self.ranks[j]}: {OpSpec(spec.group, int(seq or -1), op, dtype, dims, arg).describe()}"
            )
        raise self._fail(
            CollectiveMismatch(
                f"collective mismatch in group '{spec.group}' at op #{spec.seq}: "
                + "; ".join(parts)
                + "; every rank of a group must issue the same collectives in the same order with the same "
                "dtype and shape"
            )
        )

    def _first_sync(self, spec: OpSpec, deadline: float, first: bool) -> None:
        self._sync(deadline)
        if first:
            self._check_specs(spec)

    def _slots(self, dtype: np.dtype[Any]) -> np.ndarray:
        bank = self._data[self._bank]
        self._bank ^= 1
        usable = self.slot_bytes // dtype.itemsize * dtype.itemsize
        return bank[:, :usable].view(dtype)

    def _rounds(self, total: int, per_round: int) -> list[tuple[int, int]]:
        return [(s, min(s + per_round, total)) for s in range(0, total, per_round)] or [(0, 0)]

    # -- collectives (flat: 1-D contiguous numpy arrays) ------------------------------------------
    def all_reduce(self, spec: OpSpec, flat: np.ndarray, op: str, deadline: float) -> None:
        self._begin(spec)
        ufunc = reduce_ufunc(op)
        me = self.index
        per_round = self.slot_bytes // flat.itemsize
        for r, (s, e) in enumerate(self._rounds(flat.size, per_round)):
            m = e - s
            slots = self._slots(flat.dtype)
            slots[me, :m] = flat[s:e]
            self._first_sync(spec, deadline, r == 0)
            bounds = split_bounds(m, self.n)
            a, b = bounds[me]
            if b > a:
                acc = flat[s + a : s + b]
                ufunc(slots[0, a:b], slots[1, a:b], out=acc)
                for j in range(2, self.n):
                    ufunc(acc, slots[j, a:b], out=acc)
                slots[me, a:b] = acc
            self._sync(deadline)
            for j, (ja, jb) in enumerate(bounds):
                if j != me:
                    flat[s + ja : s + jb] = slots[j, ja:jb]

    def reduce_scatter(
        self,
        spec: OpSpec,
        flat: np.ndarray,
        bounds: list[tuple[int, int]],
        op: str,
        out: np.ndarray,
        deadline: float,
    ) -> None:
        """``out`` receives the reduction of this rank's piece ``bounds[index]`` of ``flat``."""
        self._begin(spec)
        ufunc = reduce_ufunc(op)
        a, b = bounds[self.index]
        per_round = self.slot_bytes // flat.itemsize
        for r, (s, e) in enumerate(self._rounds(flat.size, per_round)):
            slots = self._slots(flat.dtype)
            slots[self.index, : e - s] = flat[s:e]
            self._first_sync(spec, deadline, r == 0)
            lo, hi = max(a, s), min(b, e)
            if hi > lo:
                dst = out[lo - a : hi - a]
                ufunc(slots[0, lo - s : hi - s], slots[1, lo - s : hi - s], out=dst)
                for j in range(2, self.n):
                    ufunc(dst, slots[j, lo - s : hi - s], out=dst)

    def _exchange(
        self, spec: OpSpec, piece: np.ndarray, out: np.ndarray | None, deadline: float, *, writer: int | None
    ) -> None:
        """Every rank (or only ``writer``) publishes ``piece``; ``out`` (if given) collects all pieces."""
        self._begin(spec)
        per_round = self.slot_bytes // piece.itemsize
        size = piece.size
        for r, (s, e) in enumerate(self._rounds(size, per_round)):
            slots = self._slots(piece.dtype)
            if writer is None or writer == self.index:
                slots[self.index, : e - s] = piece[s:e]
            self._first_sync(spec, deadline, r == 0)
            if out is not None:
                for j in range(self.n) if writer is None else [writer]:
                    base = j * size if writer is None else 0
                    out[base + s : base + e] = slots[j, : e - s]

    def all_gather(self, spec: OpSpec, piece: np.ndarray, out: np.ndarray, deadline: float) -> None:
        self._exchange(spec, piece, out, deadline, writer=None)

    def gather(
        self, spec: OpSpec, piece: np.ndarray, root: int, out: np.ndarray | None, deadline: float
    ) -> None:
        self._exchange(spec, piece, out if self.index == root else None, deadline, writer=None)

    def broadcast(self, spec: OpSpec, flat: np.ndarray, root: int, deadline: float) -> None:
        self._exchange(spec, flat, None if self.index == root else flat, deadline, writer=root)

    def scatter(
        self, spec: OpSpec, pieces: Sequence[np.ndarray] | None, root: int, out: np.ndarray, deadline: float
    ) -> None:
        self._begin(spec)
        per_round = self.slot_bytes // out.itemsize
        for r, (s, e) in enumerate(self._rounds(out.size, per_round)):
            slots = self._slots(out.dtype)
            if self.index == root:
                assert pieces is not None
                for j in range(self.n):
                    slots[j, : e - s] = pieces[j][s:e]
            self._first_sync(spec, deadline, r == 0)
            out[s:e] = slots[self.index, : e - s]

    def all_to_all(self, spec: OpSpec, flat: np.ndarray, out: np.ndarray, deadline: float) -> None:
        """Each round, a rank's slot holds ``n`` sub-slots, one per destination; one sync per round (the two
        banks alternate, as in ``_exchange``)."""
        self._begin(spec)
        n, me = self.n, self.index
        size = flat.size // n
        sub = self.slot_bytes // flat.itemsize // n
        assert sub > 0, "a shm slot holds at least one element per rank"
        for r, (s, e) in enumerate(self._rounds(size, sub)):
            m = e - s
            slots = self._slots(flat.dtype)
            mine = slots[me]
            for j in range(n):
                mine[j * sub : j * sub + m] = flat[j * size + s : j * size + e]
            self._first_sync(spec, deadline, r == 0)
            for j in range(n):
                out[j * size + s : j * size + e] = slots[j, me * sub : me * sub + m]

    def all_to_allv(
        self, spec: OpSpec, flat: np.ndarray, out: np.ndarray, splits: Splits, deadline: float
    ) -> None:
        """Each rank's input streams through its whole slot, one slot's worth a round (one sync per round, the
        banks alternating), and each rank reads its piece out of every other rank's slot where it lies: as
        many rounds as the longest input needs, whatever the pieces' sizes (``all_to_all``'s sub-slot per
        destination would take as many as the longest piece fills a sub-slot)."""
        self._begin(spec)
        n, me = self.n, self.index
        per_round = self.slot_bytes // flat.itemsize
        into = Splits.starts(splits.receives(me))
        pieces = [(Splits.starts(splits.sends(i))[me], splits.counts[i][me]) for i in range(n)]
        at, size = pieces[me]
        out[into[me] : into[me] + size] = flat[at : at + size]
        longest = max(sum(row) for row in splits.counts)
        for r, (s, e) in enumerate(self._rounds(longest, per_round)):
            slots = self._slots(flat.dtype)
            if flat.size > s:
                end = min(e, flat.size)
                slots[me, : end - s] = flat[s:end]
            self._first_sync(spec, deadline, r == 0)
            for i, (at, size) in enumerate(pieces):
                lo, hi = max(at, s), min(at + size, e)
                if i != me and lo < hi:
                    out[into[i] + lo - at : into[i] + hi - at] = slots[i, lo - s : hi - s]

    def barrier(self, spec: OpSpec, deadline: float) -> None:
        self._begin(spec)
        self._first_sync(spec, deadline, True)
