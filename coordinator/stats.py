"""What the live view shows beyond liveness: every rank's counters, the job's training rate and its history.

Pure bookkeeping fed by heartbeats (``CoordinatorState.heartbeat``), with explicit time like the state.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from paramplane.coordinator.model import RankStats

HISTORY_POINTS = 600
"""Reports kept for the chart (one per heartbeat of the reference rank at most: 10 minutes at 1 s)."""
RATE_WINDOW_S = 10.0
"""The window steps/s and tokens/s are measured over."""


@dataclass(frozen=True)
class _Point:
    at: float
    step: int
    loss: float
    tokens: int  # summed over every rank


class JobStats:
    """Counters of one world's ranks and the reports of its lowest reporting rank."""

    def __init__(self, world_size: int) -> None:
        self.ranks: list[RankStats | None] = [None] * world_size
        self._history: collections.deque[_Point] = collections.deque(maxlen=HISTORY_POINTS)
        self._tokens = 0  # summed over every rank's last heartbeat
        self._reference = world_size  # the lowest rank that reported so far

    def update(self, rank: int, stats: RankStats, now: float) -> None:
        old = self.ranks[rank]
        self._tokens += stats.tokens - (old.tokens if old is not None else 0)
        self.ranks[rank] = stats
        if not stats.reported or rank > self._reference:
            return
        if rank < self._reference:  # a lower rank reports: the chart follows it from now on
            self._reference = rank
            self._history.clear()
        last = self._history[-1] if self._history else None
        if last is None or last.step != stats.step or last.tokens != self._tokens:
            self._history.append(_Point(now, stats.step, stats.loss, self._tokens))

    def rates(self, now: float) -> tuple[float, float]:
        """(steps/s, tokens/s) between the reports of the last ``RATE_WINDOW_S`` seconds; 0 with fewer than two
        (a stalled job drops to 0 once its last reports leave the window)."""
        recent = [p for p in self._history if p.at >= now - RATE_WINDOW_S]
        if len(recent) < 2 or recent[-1].at <= recent[0].at:
            return 0.0, 0.0
        first, last = recent[0], recent[-1]
        span = last.at - first.at
        return (last.step - first.step) / span, (last.tokens - first.tokens) / span

    def history(self, now: float) -> list[dict[str, Any]]:
        """The reference rank's reports, oldest first, with the tokens/s since the report before."""
        out: list[dict[str, Any]] = []
        previous: _Point | None = None
        for p in self._history:
            rate = 0.0
            if previous is not None and p.at > previous.at:
                rate = (p.tokens - previous.tokens) / (p.at - previous.at)
            out.append({"s_ago": now - p.at, "step": p.step, "loss": p.loss, "tokens_per_s": rate})
            previous = p
        return out

    def rank_dict(self, rank: int) -> dict[str, Any]:
        s = self.ranks[rank] or RankStats()
        return {
            "bytes_by_transport": dict(s.bytes_by_transport),
            "ops_by_transport": dict(s.ops_by_transport),
            "reported": s.reported,
            "step": s.step,
            "loss": s.loss,
            "tokens": s.tokens,
            "num_checkpoint_commits": s.num_checkpoint_commits,
            "checkpoint_commit_s": s.checkpoint_commit_s,
        }
