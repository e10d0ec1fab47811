"""Bringing a replaced DiLoCo replica back: ``DiLoCo.rejoin`` after ``world.reform()``.

Between syncs DiLoCo issues no collective, so a lost replica is noticed at the next sync: its collective
fails with a ``PlaneError`` (``PeerLost``) raised from the inner optimizer's ``step()`` (DiLoCo's post-step
hook), after the inner step itself was applied. The failed sync stays pending (nothing was modified: a sync
waits for its collective before it touches a parameter). The survivors ``world.reform()``, the replacement
joins, and every replica calls ``rejoin``:

1. the flags of every rank (has state, the fragment of a failed sync, a sync due but never started) are
   all-gathered; the lowest rank with state is the source;
2. ``pp.checkpoint.sync({"diloco": ...})`` sends the source's ``last``, outer optimizer state and step count
   to every other rank (replicas hold the same already; a replacement gets them);
3. a rank without state sets its parameters to ``last``: the replica restarts from the last sync;
4. the failed sync is redone from the same inputs (``last - parameters``, or with ``overlap`` the snapshot
   taken when it started; the replacement's is ``last``, so its outer gradient is zero) and applied at once;
   a sync due at this step that never started starts now (and with ``overlap`` is applied after the next step).

A replica of several ranks (``pp.DDP``/``pp.FSDP`` inside a host) that lost a rank is incomplete: every rank
of it passes ``has_state=False`` (after the wrapper's own recovery), so the whole replica restarts from
``last``. The replacement's inner optimizer starts fresh (its state since the last sync is lost too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from paramplane.group import ProcessGroup

if TYPE_CHECKING:
    from paramplane.parallel.diloco import DiLoCo


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
    unstarted = d.step > 0 and d.step % d.interval == 0 and d._started != d.step
    mine = np.array([int(has_state), -1 if failed is None else failed.fragment, int(unstarted)], np.int64)
    flags = np.asarray(d.group.all_gather(mine)).reshape(d.group.size, 3)
    checkpoint.sync({"diloco": d}, d.group, has_state=has_state)  # CheckpointError when no rank has state
    src = next(r for r in range(d.group.size) if flags[r, 0])
    redo, due = int(flags[src, 1]), bool(flags[src, 2])
    if not has_state:
        for i in range(len(d.params)):
            d._values(i)[...] = d.last[i]
    if redo >= 0:
        idx = d.fragment_indices[redo]
        base = None
        if d.overlap:  # the snapshot the failed sync started from; the replacement's is last
            mine_ok = has_state and failed is not None and failed.fragment == redo
            base = failed.snap if mine_ok and failed is not None else [d.last[i].copy() for i in idx]
        d._pending = d._start(redo, base)
        d.finish()
    d._started = -1 if due else d.step
    if due:
        d._sync_due()
    return d.step
