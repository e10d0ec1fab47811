"""A rank's counters for the coordinator's live view: bytes and ops per transport, the job's own reports and
checkpoint commits. Updated in place (a lock, no I/O) and sent with every heartbeat, never per op."""

from __future__ import annotations

import math
import threading

from paramplane.coordinator.model import RankStats


class RankCounters:
    """Cumulative counters of one rank (thread-safe; ``snapshot()`` is what the next heartbeat carries)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[str, int] = {}
        self._ops: dict[str, int] = {}
        self._reported = False
        self._step = 0
        self._loss = 0.0
        self._tokens = 0
        self._num_commits = 0
        self._commit_s = 0.0

    def count_op(self, transport: str, nbytes: int) -> None:
        """One collective or message of ``nbytes`` payload bytes went over ``transport``."""
        with self._lock:
            self._bytes[transport] = self._bytes.get(transport, 0) + nbytes
            self._ops[transport] = self._ops.get(transport, 0) + 1

    def report(self, step: int, loss: float | None, tokens: int) -> None:
        """The job's progress (``World.report``): ``tokens`` are added to the rank's total."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens must be an int >= 0, got {tokens!r}")
        value = math.nan if loss is None else float(loss)
        with self._lock:
            self._reported = True
            self._step = step
            self._loss = value
            self._tokens += tokens

    def checkpoint_committed(self, seconds: float) -> None:
        with self._lock:
            self._num_commits += 1
            self._commit_s += seconds

    def snapshot(self) -> RankStats:
        with self._lock:
            return RankStats(
                bytes_by_transport=dict(self._bytes),
                ops_by_transport=dict(self._ops),
                reported=self._reported,
                step=self._step,
                loss=self._loss,
                tokens=self._tokens,
                num_checkpoint_commits=self._num_commits,
                checkpoint_commit_s=self._commit_s,
            )
