"""Bringing DiLoCo's replicas back into agreement after a lost replica: ``DiLoCo.rejoin`` after
``world.reform()``.

Between syncs DiLoCo issues no collective, so a replica lost then is noticed at the next sync: its collective
fails with a ``PlaneError`` (``PeerLost``) raised from the inner optimizer's ``step()`` (DiLoCo's post-step
hook), after the inner step itself was applied. A replica lost *during* a sync's collective can leave the
survivors split: some received every replica's contribution and applied the sync, others did not (a sync
waits for its collective before it touches a parameter, so a failed one modified nothing). The survivors
``world.reform()``, the replacements join, and every rank calls ``rejoin``:

1. every rank tells its replicate group (and, for a ``pp.DDP``/``pp.FSDP`` replica, its own group) whether it
   has state and how many syncs it applied; the lowest and highest counts over the ranks with state are
   agreed world-wide (a minimum over the replicate group, then over the replica's group);
2. ranks that applied one sync more than the lowest **roll it back** from the record :func:`record_undo`
   kept (the fragment's values before the sync, ``last`` and the outer optimizer's state for it; local
   progress made since is kept), so no survivor keeps an outcome another could not reach;
3. ``pp.checkpoint.sync({"diloco": ...})`` sends ``last``, the outer optimizer's state and the step count
   of the lowest rank with state to every other rank (replicas hold the same already: they keep their own
   step count; a replacement takes the source's and sets its parameters to ``last``, restarting from the
   last agreed sync);
4. every sync due by the step count that is not applied is (re)done, in order, from the same inputs as
   before (``last - parameters`` at its start: the snapshot a failed or rolled-back sync took, a
   replacement's ``last``, whose outer gradient is zero). It is applied at once, except the one started at
   this very step with ``overlap``, which is applied after the next inner step as usual.

A replica of several ranks (``pp.DDP``/``pp.FSDP`` inside a host) that lost some of its ranks is
incomplete: every rank of it passes ``has_state=False`` (after the wrapper's own recovery), so the whole
replica restarts from ``last``. A replica whose ranks were all lost is replaced the same way. A
replacement's inner optimizer starts fresh (its state since the last sync is lost too).

Memory: the undo record holds the synced fragment's values before the sync and its previous ``last``
(two fragment-sized copies: the whole model with ``fragments=1``) and its outer optimizer state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from paramplane.group import ProcessGroup

if TYPE_CHECKING:
    from paramplane.parallel.diloco import DiLoCo, _Pending


@dataclass
class Undo:
    """What taking back the last applied sync needs (kept until the next sync is applied)."""

    number: int
    """The sync's number (1, 2, ...)."""
    step: int
    """The inner step count when it was applied."""
    before: list[Any]
    """The fragment's values just before the sync modified them."""
    last: list[Any]
    """The fragment's ``last`` before the sync."""
    snap: list[Any]
    """The values the outer gradient was taken from (``before`` without overlap)."""
    drift: list[Any]
    """With overlap: the local progress added after the outer step (empty otherwise)."""
    slots: list[Any]
    """The outer optimizer's state of each of the fragment's parameters (None: it had none)."""


def _copy(value: Any) -> Any:
    if hasattr(value, "clone"):  # a torch tensor
        return value.clone()
    return value.copy() if hasattr(value, "copy") else value


def _slot_keys(d: DiLoCo, idx: list[int]) -> list[Any]:
    """The outer optimizer's state keys of parameters ``idx``: a ``pp.optim`` index, or the torch tensor."""
    from paramplane.optim.optimizer import Optimizer

    opt = d.outer_optimizer
    if isinstance(opt, Optimizer):
        where = {id(p): k for k, p in enumerate(opt.params)}
        return [where[id(d.params[i])] for i in idx]
    return [d.params[i] for i in idx]


def record_undo(d: DiLoCo, pending: _Pending, drift: list[Any]) -> Undo:
    """Called by ``_apply`` once the collective is done, before anything is modified."""
    idx = d.fragment_indices[pending.fragment]
    state = d.outer_optimizer.state
    slots = []
    for key in _slot_keys(d, idx):
        slot = state.get(key)
        slots.append(None if slot is None else {k: _copy(v) for k, v in slot.items()})
    before = [d._values(i).copy() for i in idx]
    return Undo(
        number=pending.number,
        step=d.step,
        before=before,
        last=[d.last[i].copy() for i in idx],
        snap=[s.copy() for s in pending.snap] if pending.snap else before,
        drift=drift,
        slots=slots,
    )


def roll_back(d: DiLoCo) -> Undo:
    """Take the last applied sync back: parameters as before it plus the local progress made since, ``last``
    and the outer optimizer's state as before it. Returns the record (its ``snap`` redoes the sync)."""
    undo = d._undo
    assert undo is not None and undo.number == d.num_applied, "no record of the last applied sync"
    idx = d.fragment_indices[(undo.number - 1) % d.fragments]
    for k, i in enumerate(idx):
        applied = d.last[i] + undo.drift[k] if undo.drift else d.last[i]
        values = d._values(i)
        values[...] = undo.before[k] + (values - applied) if d.step != undo.step else undo.before[k]
        d.last[i][...] = undo.last[k]
    state = d.outer_optimizer.state
    for key, slot in zip(_slot_keys(d, idx), undo.slots, strict=True):
        if slot is None:
            state.pop(key, None)
        else:
            state[key] = slot
    d.num_applied, d._undo = undo.number - 1, None
    return undo


def _agree(d: DiLoCo, has_state: bool) -> int:
    """The lowest ``num_applied`` over every rank with state, world-wide (checked: the highest is one more
    at most)."""
    from paramplane.checkpoint import CheckpointError

    mine = np.array([int(has_state), d.num_applied if has_state else -1], np.int64)
    flags = np.asarray(d.group.all_gather(mine)).reshape(d.group.size, 2)
    held = flags[flags[:, 0] == 1, 1]
    span = np.array([held.min(), held.max()] if held.size else [np.iinfo(np.int64).max, -1], np.int64)
    own = getattr(d.model, "group", None)
    if isinstance(own, ProcessGroup) and own.size > 1:  # the replica's other ranks sit in other groups
        spans = np.asarray(own.all_gather(span)).reshape(own.size, 2)
        span = np.array([spans[:, 0].min(), spans[:, 1].max()], np.int64)
    lo, hi = int(span[0]), int(span[1])
    if hi > lo + 1:
        raise CheckpointError(
            f"DiLoCo.rejoin: ranks with state applied between {lo} and {hi} syncs; they can differ by one "
            "sync at most (one lost during its collective)"
        )
    return lo


def rejoin(d: DiLoCo, group: ProcessGroup | None, *, has_state: bool) -> int:
    """See :meth:`DiLoCo.rejoin` and the module docstring. Returns the step count."""
    from paramplane import checkpoint  # paramplane.checkpoint imports the parallel wrappers

    if group is not None:
        if not isinstance(group, ProcessGroup):
            raise ValueError(f"rejoin needs a ProcessGroup of replicas, got {type(group).__name__}")
        d.group = group
    if not isinstance(has_state, bool):
        raise ValueError(f"has_state must be a bool, got {has_state!r}")
    failed, d._pending = d._pending, None
    lo = _agree(d, has_state)
    snaps: dict[int, list[Any]] = {}  # sync number -> the values its outer gradient is taken from
    if failed is not None and failed.snap:
        snaps[failed.number] = failed.snap
    if has_state and d.num_applied > lo:
        idx = d.fragment_indices[(d.num_applied - 1) % d.fragments]
        held = [d._values(i).copy() for i in idx]
        undo = roll_back(d)  # (not ``snaps[d.num_applied] = ...``: roll_back lowers num_applied first)
        snaps[undo.number] = undo.snap
        later = snaps.get(undo.number + d.fragments)  # this fragment's failed next sync, snapped before
        if later is not None:  # the rollback moved the values it was taken from
            for k, i in enumerate(idx):
                later[k] = later[k] + (d._values(i) - held[k])
    step = d.step
    checkpoint.sync({"diloco": d}, d.group, has_state=has_state)  # CheckpointError when no rank has state
    d._undo, d.num_applied = None, lo
    if has_state:
        d.step = step  # replicas agree on the rest; their step counts may differ
    else:
        snaps = {}
        for i in range(len(d.params)):
            d._values(i)[...] = d.last[i]
    number = d.num_applied + 1
    while number * d.interval <= d.step:
        idx = d.fragment_indices[(number - 1) % d.fragments]
        base = snaps.get(number)
        now = [d._values(i).copy() for i in idx]
        pending = d._start(number, base if base is not None else now, keep=True)
        if d.overlap and number * d.interval == d.step:
            d._pending = pending  # started at this step: applied after the next one, as usual
            break
        d._pending = pending
        d.finish()
        later = snaps.get(number + d.fragments)  # the same fragment's next sync (one that failed, after this)
        if later is not None:  # its snapshot moves with what redoing this one changed
            for k, i in enumerate(idx):
                later[k] = later[k] + (d._values(i) - now[k])
        number += 1
    d._started = d.step - d.step % d.interval
    return d.step
