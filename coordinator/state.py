"""The coordinator's decisions: pure functions of state and an explicit ``now``.

No I/O, no asyncio, no clock reads. A blocking call (join, barrier, kv wait) is
registered as a *waiter* under an id the caller picks; every method leaves its
consequences in a buffer that ``take_effects()`` hands over: waiters to resolve
(with a value or a ``StateError``) and watch events to publish.
"""

from __future__ import annotations

import bisect
import heapq
import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from paramplane.coordinator.model import (
    Assignment,
    Effects,
    ErrorKind,
    Event,
    EventKind,
    Joiner,
    RankStats,
    Resolution,
    StateError,
    assign_ranks,
)
from paramplane.coordinator.stats import JobStats
from paramplane.protos.net import check_seconds

MAX_KEY_BYTES = 1024
MAX_VALUE_BYTES = 4 * 1024 * 1024
MAX_KV_KEYS = 100_000
"""Keys one world's store may hold (one job, one token); a runaway writer cannot exhaust the coordinator."""
MAX_KV_BYTES = 256 * 1024 * 1024
"""Bytes of keys and values one world's store may hold."""
_INT64 = (-(2**63), 2**63 - 1)


@dataclass
class _Pending:
    joiner: Joiner
    waiter: int
    arrived: float


@dataclass
class _Barrier:
    ranks: tuple[int, ...]
    first_rank: int
    arrived: dict[int, int] = field(default_factory=dict)  # rank -> waiter
    members: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        self.members = frozenset(self.ranks)


@dataclass
class _Wait:
    """A waiting barrier or kv-get call."""

    kind: str  # "barrier" | "kv"
    key: str  # barrier name or kv key
    ranks: tuple[int, ...]  # a barrier's arriving ranks (one waiter may stand for a host's)
    timeout_s: float
    deadline: float


@dataclass
class _Progress:
    issued: int
    completed: int
    changed_at: float


@dataclass
class _World:
    members: dict[str, Assignment]  # instance id -> assignment
    joiners: tuple[Joiner, ...]  # by rank
    formed_at: float
    last_seen: list[float | None]
    left: set[int] = field(default_factory=set)
    progress: dict[str, dict[int, _Progress]] = field(default_factory=dict)  # group -> rank -> progress
    # group -> (most issued by any rank, when first reported), increasing: when op n was first issued anywhere.
    issued_at: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    abort: Event | None = None
    agent: dict[int, str] = field(default_factory=dict)  # rank -> host agent carrying its heartbeats
    callers: dict[str, float] = field(default_factory=dict)  # heartbeat caller (rank or agent) -> last call
    stats: JobStats = field(init=False)

    def __post_init__(self) -> None:
        self.stats = JobStats(len(self.joiners))


class CoordinatorState:
    """Rendezvous, KV store, barriers and liveness of one world, driven by explicit time."""

    def __init__(
        self,
        world_size: int,
        *,
        join_timeout_s: float = 300.0,
        heartbeat_timeout_s: float = 10.0,
        progress_timeout_s: float = 300.0,
        new_job_id: Callable[[], str] = lambda: secrets.token_hex(8),
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        check_seconds(join_timeout_s, "join_timeout_s", upper=None)
        check_seconds(heartbeat_timeout_s, "heartbeat_timeout_s", upper=None)
        check_seconds(progress_timeout_s, "progress_timeout_s", allow_zero=True, upper=None)
        self.world_size = world_size
        self._world_ranks = tuple(range(world_size))
        self.epoch = 1
        self.join_timeout_s = join_timeout_s
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._progress_timeout_s = progress_timeout_s
        self._new_job_id = new_job_id
        self._pending: dict[str, _Pending] = {}  # instance id -> joiner, in arrival order
        self._hinted: dict[int, str] = {}  # rank hint -> pending instance id
        self.world: _World | None = None
        self._kv: dict[str, bytes] = {}
        self._kv_bytes = 0
        self._barriers: dict[str, _Barrier] = {}
        self._waits: dict[int, _Wait] = {}
        self._effects = Effects()
        self.num_aborts = 0
        self.num_restarts = 0
        self.num_reforms = 0
        self._previous_processes: set[tuple[str, int]] = set()  # (host, pid) of the aborted world's ranks

    # -- plumbing ---------------------------------------------------------------------------------
    def take_effects(self) -> Effects:
        """Hand over (and forget) what the calls since the last take decided."""
        effects, self._effects = self._effects, Effects()
        return effects

    def _resolve(self, waiter: int, value: object = None, error: StateError | None = None) -> None:
        self._effects.resolved.append(Resolution(waiter, value, error))

    def next_deadline(self) -> float | None:
        """The earliest time at which ``tick`` would time out a waiter (None when nothing waits)."""
        deadlines = [w.deadline for w in self._waits.values()]
        if self._pending:
            deadlines.append(next(iter(self._pending.values())).arrived + self.join_timeout_s)
        return min(deadlines, default=None)

    @property
    def aborted(self) -> Event | None:
        return self.world.abort if self.world else None

    def status(self, now: float) -> dict[str, Any]:
        """The world as this coordinator sees it (a plain dict; ``paramplane status`` prints it)."""
        out: dict[str, Any] = {
            "epoch": self.epoch,
            "world_size": self.world_size,
            "num_waiting": len(self._pending),
            "formed": self.world is not None,
            "num_aborts": self.num_aborts,
            "num_restarts": self.num_restarts,
            "num_reforms": self.num_reforms,
        }
        w = self.world
        if w is None:
            return out
        job = next(iter(w.members.values())).job_id if w.members else ""
        out.update(job_id=job, formed_s_ago=now - w.formed_at)
        out["ranks"] = [
            {
                "rank": r,
                "host_id": j.host_id,
                "address": j.peer_address,
                "pid": j.pid,
                "since_heartbeat_s": (now - seen) if (seen := w.last_seen[r]) is not None else -1.0,
                "left": r in w.left,
                "stats": w.stats.rank_dict(r),
                "agent": w.agent.get(r, ""),
            }
            for r, j in enumerate(w.joiners)
        ]
        out["num_heartbeat_callers"] = sum(
            now - seen <= self._heartbeat_timeout_s for seen in w.callers.values()
        )
        out["steps_per_s"], out["tokens_per_s"] = w.stats.rates(now)
        out["history"] = w.stats.history(now)
        out["groups"] = [
            {
                "group": g,
                "ranks": sorted(per),
                "issued": [per[r].issued for r in sorted(per)],
                "completed": [per[r].completed for r in sorted(per)],
                "unchanged_s": [now - per[r].changed_at for r in sorted(per)],
            }
            for g, per in sorted(w.progress.items())
        ]
        if w.abort is not None:
            out.update(aborted=True, abort_reason=w.abort.reason, abort_rank=w.abort.rank)
        return out

    # -- rendezvous -------------------------------------------------------------------------------
    def join(self, joiner: Joiner, waiter: int, now: float) -> None:
        """Wait for the world; the waiter is resolved with an Assignment once N have joined."""
        n = self.world_size
        if not joiner.instance_id or not joiner.host_id:
            raise StateError(ErrorKind.INVALID_ARGUMENT, "join needs a non-empty instance_id and host_id")
        if self.world is not None and (
            self.world.abort is not None or len(self.world.left) == self.world_size
        ):
            self._next_epoch()  # the old world is over: this join starts forming the next one
        if self.world is not None:
            if joiner.instance_id in self.world.members:
                rank = self.world.members[joiner.instance_id].rank
                raise StateError(
                    ErrorKind.ALREADY_EXISTS, f"instance {joiner.instance_id} already joined (rank {rank})"
                )
            raise StateError(
                ErrorKind.RESOURCE_EXHAUSTED,
                f"world is full ({n} ranks): the world already formed; is an extra rank running, "
                "or does --world-size disagree with the number of ranks started?",
            )
        if joiner.world_size not in (0, n):
            raise StateError(
                ErrorKind.FAILED_PRECONDITION,
                f"this rank expects world size {joiner.world_size} but the coordinator was started "
                f"with --world-size {n}: start both with the same size",
            )
        if joiner.instance_id in self._pending:
            raise StateError(ErrorKind.ALREADY_EXISTS, f"instance {joiner.instance_id} already joined")
        if not -1 <= joiner.rank_hint < n:
            raise StateError(
                ErrorKind.INVALID_ARGUMENT,
                f"rank hint {joiner.rank_hint} is outside 0..{n - 1} (or -1 for none)",
            )
        if (taken := self._hinted.get(joiner.rank_hint)) is not None:
            p = self._pending[taken]
            raise StateError(
                ErrorKind.ALREADY_EXISTS,
                f"rank hint {joiner.rank_hint} is already taken by instance {p.joiner.instance_id} "
                f"(host {p.joiner.host_id}, pid {p.joiner.pid}): give every rank a different hint",
            )
        self._pending[joiner.instance_id] = _Pending(joiner, waiter, now)
        if joiner.rank_hint >= 0:
            self._hinted[joiner.rank_hint] = joiner.instance_id
        if len(self._pending) == n:
            self._form(now)

    def _next_epoch(self) -> None:
        """Forget an aborted (or fully left) world: epoch + 1, an empty KV store and no barriers.

        Restarted ranks (``paramplane launch --max-restarts``, on every host) join again and form a new
        world; calls that still name the old epoch are refused ("join again").
        """
        self.epoch += 1
        if self.world is not None and self.world.abort is not None:
            self._previous_processes = {(j.host_id, j.pid) for j in self.world.joiners}
        self.world = None
        self._kv.clear()
        self._kv_bytes = 0
        self._barriers.clear()
        for waiter in list(self._waits):
            self._resolve(
                waiter, error=StateError(ErrorKind.ABORTED, "the world was replaced by a new epoch")
            )
        self._waits.clear()

    def _form(self, now: float) -> None:
        pending = list(self._pending.values())
        self._pending.clear()
        self._hinted.clear()
        members = assign_ranks([p.joiner for p in pending], self.epoch, self._new_job_id())
        joiners = sorted((p.joiner for p in pending), key=lambda j: members[j.instance_id].rank)
        self.world = _World(members, tuple(joiners), now, [None] * self.world_size)
        if self._previous_processes:
            if self._previous_processes.intersection((j.host_id, j.pid) for j in joiners):
                self.num_reforms += 1
            else:
                self.num_restarts += 1
            self._previous_processes = set()
        for p in pending:
            self._resolve(p.waiter, members[p.joiner.instance_id])
        self._effects.formed = tuple(sorted(members.values(), key=lambda a: a.rank))

    def cancel(self, waiter: int) -> None:
        """Forget a waiter whose caller went away (its join or barrier arrival is withdrawn)."""
        for instance_id, p in list(self._pending.items()):
            if p.waiter == waiter:
                del self._pending[instance_id]
                self._hinted.pop(p.joiner.rank_hint, None)
        wait = self._waits.pop(waiter, None)
        if wait is not None and wait.kind == "barrier":
            barrier = self._barriers.get(wait.key)
            if barrier is not None:
                for rank in wait.ranks:
                    if barrier.arrived.get(rank) == waiter:
                        del barrier.arrived[rank]
                if not barrier.arrived:
                    del self._barriers[wait.key]

    # -- world checks -----------------------------------------------------------------------------
    def _aborted_error(self, abort: Event) -> StateError:
        return StateError(ErrorKind.ABORTED, f"the world aborted: {abort.reason}", rank=abort.rank)

    def member(self, epoch: int, rank: int | None = None, *, allow_aborted: bool = False) -> _World:
        """The world, if ``epoch`` is current (and ``rank`` in it); raises StateError otherwise."""
        world = self.world
        if epoch != self.epoch:
            raise StateError(
                ErrorKind.FAILED_PRECONDITION,
                f"epoch {epoch} is not the current epoch {self.epoch}: join again",
            )
        if world is None:
            raise StateError(ErrorKind.FAILED_PRECONDITION, "the world has not formed yet: join first")
        if world.abort is not None and not allow_aborted:
            raise self._aborted_error(world.abort)
        if rank is not None and not 0 <= rank < self.world_size:
            raise StateError(
                ErrorKind.INVALID_ARGUMENT, f"rank {rank} is not in the world of {self.world_size}"
            )
        return world

    def snapshot_events(self, epoch: int, rank: int) -> list[Event]:
        """What a new watch subscriber is told first: membership, the ranks that left already, and the abort if
        there was one."""
        world = self.member(epoch, rank, allow_aborted=True)
        events = [Event(EventKind.MEMBERSHIP, self.epoch, rank)]
        events += [Event(EventKind.LEFT, self.epoch, r, f"rank {r} left") for r in sorted(world.left)]
        return events + ([world.abort] if world.abort else [])

    # -- key/value store --------------------------------------------------------------------------
    @staticmethod
    def _check_key(key: str) -> None:
        if not key or len(key.encode()) > MAX_KEY_BYTES:
            raise StateError(ErrorKind.INVALID_ARGUMENT, f"key must be 1..{MAX_KEY_BYTES} bytes of UTF-8")

    def _store(self, key: str, value: bytes) -> None:
        if len(value) > MAX_VALUE_BYTES:
            raise StateError(
                ErrorKind.INVALID_ARGUMENT,
                f"value for key {key!r} is {len(value)} bytes; the limit is {MAX_VALUE_BYTES} bytes",
            )
        old = self._kv.get(key)
        grown = len(value) - (len(old) if old is not None else -len(key.encode()))
        if old is None and len(self._kv) >= MAX_KV_KEYS:
            raise StateError(
                ErrorKind.RESOURCE_EXHAUSTED,
                f"the key/value store holds {len(self._kv)} keys, its limit: delete keys you no longer need",
            )
        if self._kv_bytes + grown > MAX_KV_BYTES:
            raise StateError(
                ErrorKind.RESOURCE_EXHAUSTED,
                f"storing {key!r} would take the key/value store past {MAX_KV_BYTES} bytes: delete keys you no "
                "longer need",
            )
        self._kv[key] = value
        self._kv_bytes += grown
        for waiter, wait in list(self._waits.items()):
            if wait.kind == "kv" and wait.key == key:
                del self._waits[waiter]
                self._resolve(waiter, value)

    def kv_set(self, epoch: int, key: str, value: bytes) -> None:
        self.member(epoch)
        self._check_key(key)
        self._store(key, value)

    def kv_get(self, epoch: int, key: str) -> bytes | None:
        self.member(epoch)
        self._check_key(key)
        return self._kv.get(key)

    def kv_wait(self, epoch: int, key: str, timeout_s: float, waiter: int, now: float) -> None:
        """Resolve ``waiter`` with the value of ``key`` once it exists, or fail after ``timeout_s``."""
        value = self.kv_get(epoch, key)
        if not 0 < timeout_s < math.inf:
            raise StateError(
                ErrorKind.INVALID_ARGUMENT, f"a waiting get needs a finite timeout_s > 0, got {timeout_s}"
            )
        if value is not None:
            self._resolve(waiter, value)
        else:
            self._waits[waiter] = _Wait("kv", key, (), timeout_s, now + timeout_s)

    def kv_add(self, epoch: int, key: str, delta: int) -> int:
        old = self.kv_get(epoch, key)
        try:
            total = (int(old.decode("ascii")) if old is not None else 0) + delta
        except (UnicodeDecodeError, ValueError):
            raise StateError(
                ErrorKind.INVALID_ARGUMENT, f"key {key!r} does not hold a decimal integer: cannot add to it"
            ) from None
        if not _INT64[0] <= total <= _INT64[1]:
            raise StateError(ErrorKind.INVALID_ARGUMENT, f"adding {delta} to key {key!r} overflows int64")
        self._store(key, str(total).encode("ascii"))
        return total

    def kv_compare_set(
        self, epoch: int, key: str, expected: bytes | None, desired: bytes
    ) -> tuple[bool, bytes | None]:
        """Store ``desired`` if the value is ``expected`` (None: absent); answers (swapped, value after)."""
        current = self.kv_get(epoch, key)
        if current != expected:
            return False, current
        self._store(key, desired)
        return True, desired

    def kv_delete(self, epoch: int, key: str) -> bool:
        self.member(epoch)
        self._check_key(key)
        old = self._kv.pop(key, None)
        if old is not None:
            self._kv_bytes -= len(key.encode()) + len(old)
        return old is not None

    # -- barriers ---------------------------------------------------------------------------------
    def barrier(
        self,
        epoch: int,
        name: str,
        rank: int,
        ranks: Sequence[int],
        timeout_s: float,
        waiter: int,
        now: float,
    ) -> None:
        """Arrive at barrier ``name``; every participant is released once all of them arrived, and every
        arrival fails at once (naming it) when a participant left the world before arriving."""
        (refused,) = self.barrier_many(epoch, name, (rank,), ranks, timeout_s, waiter, now)
        if refused is not None:
            raise refused

    def barrier_many(
        self,
        epoch: int,
        name: str,
        arriving: Sequence[int],
        ranks: Sequence[int],
        timeout_s: float,
        waiter: int,
        now: float,
    ) -> list[StateError | None]:
        """``barrier`` for several ranks at once (a host's arrivals), all under one waiter: it is resolved once,
        for all of them, so a release costs one resolution per host instead of one per rank. Raises what
        refuses every arrival alike (the epoch, the name, the timeout, the participants); answers, per arriving
        rank, what refuses it alone (None: it arrived). Ranks refused are not registered; nothing is when
        every one is."""
        world = self.member(epoch)
        n = self.world_size
        if not name:
            raise StateError(ErrorKind.INVALID_ARGUMENT, "a barrier needs a name")
        if not 0 < timeout_s < math.inf:
            raise StateError(
                ErrorKind.INVALID_ARGUMENT, f"barrier {name!r} needs a finite timeout_s > 0, got {timeout_s}"
            )
        # The whole world's barrier is checked once, not at every arrival (O(ranks²) at thousands of ranks).
        participants = tuple(sorted(ranks)) if ranks else self._world_ranks
        if ranks and (
            len(set(participants)) != len(participants) or not all(0 <= r < n for r in participants)
        ):
            raise StateError(
                ErrorKind.INVALID_ARGUMENT,
                f"barrier {name!r}: ranks {list(ranks)} must be distinct ranks in 0..{n - 1}",
            )
        barrier = self._barriers.get(name)
        if barrier is not None and barrier.ranks is not participants and barrier.ranks != participants:
            raise self._fail_barrier(
                name,
                StateError(
                    ErrorKind.FAILED_PRECONDITION,
                    f"barrier {name!r}: rank {arriving[0]} passed ranks {list(participants)} but rank "
                    f"{barrier.first_rank} arrived first with ranks {list(barrier.ranks)}: every participant "
                    "must pass the same ranks",
                    mismatch=True,
                ),
            )
        arrived = barrier.arrived if barrier is not None else {}
        allowed = barrier.members if barrier is not None else frozenset(participants) if ranks else None
        refused: list[StateError | None] = []
        registered: list[int] = []
        for rank in arriving:
            if not 0 <= rank < n:
                refused.append(
                    StateError(ErrorKind.INVALID_ARGUMENT, f"rank {rank} is not in the world of {n}")
                )
            elif allowed is not None and rank not in allowed:
                refused.append(
                    StateError(
                        ErrorKind.INVALID_ARGUMENT,
                        f"barrier {name!r}: rank {rank} is not among {list(participants)}",
                    )
                )
            elif rank in arrived or rank in registered:
                refused.append(
                    StateError(
                        ErrorKind.FAILED_PRECONDITION,
                        f"barrier {name!r}: rank {rank} is already waiting there",
                    )
                )
            else:
                refused.append(None)
                registered.append(rank)
        if not registered:
            return refused
        if barrier is None:
            barrier = self._barriers[name] = _Barrier(participants, registered[0])
        for rank in registered:
            barrier.arrived[rank] = waiter
        self._waits[waiter] = _Wait("barrier", name, tuple(registered), timeout_s, now + timeout_s)
        gone = sorted(r for r in world.left if r in barrier.members)
        if gone:
            self._fail_barrier(name, self._left_error(name, gone[0]))
        elif len(barrier.arrived) == len(participants):
            del self._barriers[name]
            for other in dict.fromkeys(
                barrier.arrived.values()
            ):  # each waiter once: a host's covers its ranks
                del self._waits[other]
                self._resolve(other)
        return refused

    # -- liveness ---------------------------------------------------------------------------------
    def heartbeat(
        self,
        epoch: int,
        rank: int,
        progress: Mapping[str, tuple[int, int]],
        now: float,
        stats: RankStats | None = None,
        agent: str = "",
    ) -> Event | None:
        """Record that ``rank`` is alive, its (issued, completed) per group and its counters; answers the world's
        abort (the event its watchers get), or None. ``agent`` names the host agent that carried the beat
        (empty: the rank called itself)."""
        world = self.member(epoch, rank, allow_aborted=True)
        if world.abort is not None:
            return world.abort
        for group, (issued, completed) in progress.items():
            if not 0 <= completed <= issued:
                raise StateError(
                    ErrorKind.INVALID_ARGUMENT,
                    f"group {group!r}: progress needs 0 <= completed <= issued, got ({issued}, {completed})",
                )
        world.last_seen[rank] = now
        if agent:
            world.agent[rank] = agent
            world.callers[agent] = now
        else:
            world.callers[f"rank {rank}"] = now
        for group, (issued, completed) in progress.items():
            per_rank = world.progress.setdefault(group, {})
            old = per_rank.get(rank)
            if old is None or (old.issued, old.completed) != (issued, completed):
                per_rank[rank] = _Progress(issued, completed, now)
            marks = world.issued_at.setdefault(group, [])
            if not marks or issued > marks[-1][0]:
                marks.append((issued, now))
        if stats is not None:
            world.stats.update(rank, stats, now)
        return None

    def leave(self, epoch: int, rank: int) -> None:
        """``rank`` is done: its silence is no longer a death, and barriers still waiting for it fail."""
        world = self.member(epoch, rank, allow_aborted=True)
        if rank not in world.left and world.abort is None:
            world.left.add(rank)
            self._effects.events.append(Event(EventKind.LEFT, self.epoch, rank, f"rank {rank} left"))
            for name, barrier in list(self._barriers.items()):
                if rank in barrier.ranks and rank not in barrier.arrived:
                    self._fail_barrier(name, self._left_error(name, rank))

    def _left_error(self, name: str, left: int) -> StateError:
        barrier = self._barriers[name]
        return StateError(
            ErrorKind.FAILED_PRECONDITION,
            f"barrier {name!r}: rank {left} left the world without arriving "
            f"({len(barrier.arrived)}/{len(barrier.ranks)} arrived)",
            left=left,
        )

    def _fail_barrier(self, name: str, error: StateError) -> StateError:
        """Fail every arrival at barrier ``name`` with ``error`` and forget the barrier."""
        for waiter in dict.fromkeys(self._barriers.pop(name).arrived.values()):
            del self._waits[waiter]
            self._resolve(waiter, error=error)
        return error

    def abort(self, epoch: int, rank: int, reason: str, *, lost: bool = False) -> None:
        """``rank`` reports a fatal error: the world aborts (a second abort changes nothing). ``lost``: the
        rank's host agent saw its process die, and ``reason`` says how."""
        world = self.member(epoch, rank, allow_aborted=True)
        if world.abort is None and lost:
            self._abort(world, rank, reason or f"rank {rank} died", lost=True)
        elif world.abort is None:
            self._abort(world, rank, f"rank {rank} aborted: {reason or 'no reason given'}")

    def _abort(self, world: _World, rank: int, reason: str, *, lost: bool = False) -> None:
        world.abort = Event(EventKind.ABORT, self.epoch, rank, reason, lost)
        self.num_aborts += 1
        self._effects.events.append(world.abort)
        error = self._aborted_error(world.abort)
        for waiter in self._waits:
            self._resolve(waiter, error=error)
        self._waits.clear()
        self._barriers.clear()

    def shutdown(self) -> None:
        """The coordinator stops: every waiter fails and watchers are told."""
        error = StateError(ErrorKind.UNAVAILABLE, "the coordinator is shutting down")
        for waiter in [p.waiter for p in self._pending.values()] + list(self._waits):
            self._resolve(waiter, error=error)
        self._pending.clear()
        self._hinted.clear()
        self._waits.clear()
        self._barriers.clear()
        self._effects.events.append(
            Event(EventKind.SHUTDOWN, self.epoch, -1, "the coordinator is shutting down")
        )

    # -- time -------------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Time out waiters, declare silent ranks dead and stuck ranks stuck."""
        self._tick_join(now)
        for waiter, wait in list(self._waits.items()):
            if now >= wait.deadline:
                self._resolve(waiter, error=self._timeout_error(wait))
                self.cancel(waiter)
        world = self.world
        if world is not None and world.abort is None:
            self._tick_heartbeats(world, now)
        if world is not None and world.abort is None and self._progress_timeout_s > 0:
            self._tick_progress(world, now)

    def _tick_join(self, now: float) -> None:
        if not self._pending:
            return
        started = next(iter(self._pending.values())).arrived  # in arrival order
        if now < started + self.join_timeout_s:
            return
        k, n = len(self._pending), self.world_size
        hosts = sorted({p.joiner.host_id for p in self._pending.values()})
        error = StateError(
            ErrorKind.DEADLINE_EXCEEDED,
            f"{k}/{n} joined after {now - started:.1f} s; waiting for {n - k} more (joined from hosts {hosts}): "
            f"check that all {n} ranks were started, point at this coordinator and use the same token",
        )
        for p in self._pending.values():
            self._resolve(p.waiter, error=error)
        self._pending.clear()
        self._hinted.clear()

    def _timeout_error(self, wait: _Wait) -> StateError:
        if wait.kind == "kv":
            return StateError(
                ErrorKind.DEADLINE_EXCEEDED, f"key {wait.key!r} was not set within {wait.timeout_s:.1f} s"
            )
        barrier = self._barriers[wait.key]
        missing = [r for r in barrier.ranks if r not in barrier.arrived]
        return StateError(
            ErrorKind.DEADLINE_EXCEEDED,
            f"barrier {wait.key!r}: {len(barrier.arrived)}/{len(barrier.ranks)} arrived after "
            f"{wait.timeout_s:.1f} s; missing ranks {missing}",
        )

    def _tick_heartbeats(self, world: _World, now: float) -> None:
        for rank, seen in enumerate(world.last_seen):
            silent = now - (world.formed_at if seen is None else seen)
            if rank in world.left or silent <= self._heartbeat_timeout_s:
                continue
            joiner = world.joiners[rank]
            last = (
                "never since the world formed"
                if seen is None
                else f"{seen - world.formed_at:.1f} s after the world formed"
            )
            agent = world.agent.get(rank)
            if agent is not None and world.callers[agent] < (seen or 0.0) + self._heartbeat_timeout_s:
                # Its agent has not called since this rank's deadline: the rank's last beats may have died with
                # the agent. Its next call (the rank hangs) or its own timeout (the agent is lost) tells.
                if now - world.callers[agent] <= self._heartbeat_timeout_s:
                    continue
                ranks = sorted(r for r, a in world.agent.items() if a == agent and r not in world.left)
                self._abort(
                    world,
                    rank,
                    f"the host agent {agent} (ranks {ranks}, host {joiner.host_id}) missed heartbeats for "
                    f"{now - world.callers[agent]:.1f} s: the launcher died, hangs, or cannot reach the "
                    f"coordinator; its ranks are lost (rank {rank} first, last seen {last})",
                    lost=True,
                )
                return
            self._abort(
                world,
                rank,
                f"rank {rank} missed heartbeats for {silent:.1f} s (last seen {last}; host {joiner.host_id}, "
                f"pid {joiner.pid}): the process died, hangs, or cannot reach the coordinator",
                lost=True,
            )
            return

    def _tick_progress(self, world: _World, now: float) -> None:
        for group, per_rank in world.progress.items():
            marks = world.issued_at.get(group, [])
            # Ops every rank completed can no longer make anyone wait: forget when they were issued.
            done = min(q.completed for q in per_rank.values())
            del marks[: max(bisect.bisect_right(marks, (done, math.inf)) - 1, 0)]
            waiting: dict[int, float] = {}
            # The most any other rank issued, for every rank at once: the top two (O(ranks) per tick, not O(ranks²)).
            top = heapq.nlargest(2, ((q.issued, r) for r, q in per_rank.items()))
            (most, leader), second = top[0], (top[1][0] if len(top) > 1 else -1)
            for rank, p in per_rank.items():
                if p.completed >= (second if rank == leader else most) or rank in world.left:
                    continue
                # Waited on since its last move or since another rank first issued its next op, whichever is
                # later: a group idle for long is not stuck the moment one rank issues the next op.
                first = bisect.bisect_left(marks, (p.completed + 1, -math.inf))
                since = max(p.changed_at, marks[first][1] if first < len(marks) else now)
                waiting[rank] = now - since
            longest = max(waiting.values(), default=0.0)
            if longest <= self._progress_timeout_s:
                continue
            # Blame the rank furthest behind among all the waited-on ones, not only those past the timeout: the
            # ranks waiting on a laggard are waited on too, and one whose last report came in a beat earlier
            # than the laggard's would otherwise be named first.
            rank = min(waiting, key=lambda r: (per_rank[r].issued, per_rank[r].completed, r))
            p = per_rank[rank]
            leader = max(per_rank, key=lambda r: per_rank[r].issued)
            self._abort(
                world,
                rank,
                f"rank {rank} made no progress on group {group!r} for {longest:.1f} s "
                f"(issued {p.issued}, completed {p.completed}) while rank {leader} issued "
                f"{per_rank[leader].issued}: rank {rank} is stuck or waits on something outside the plane",
                lost=True,
            )
            return
