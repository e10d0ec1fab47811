"""``DiLoCo``: replicas that train alone for ``H`` steps and then average what they learnt (Douillard et al.,
2023), and its streaming form (fragments, overlap, quantised outer gradients; Douillard et al., 2025).

Usage (the training loop does not change)::

    mesh = pp.Mesh(world, dims=[("replicate", hosts), ("shard", ranks_per_host)])
    model = pp.FSDP(model, mesh.group("shard"))          # or pp.DDP, or a plain nn / torch module
    opt = pp.optim.AdamW(model.parameters(), lr=1e-3)     # the inner optimizer (torch.optim too)
    model.attach(opt)
    diloco = pp.DiLoCo(model, opt, mesh.group("replicate"), sync_every=50)
    for x, y in batches: ...; opt.step(); opt.zero_grad()
    diloco.finish()                                       # applies an overlapped sync still in flight

The algorithm (torchft's convention). DiLoCo keeps ``last``, a copy of the parameters at the last sync
(equal on every replica), and counts the inner optimizer's steps with a post-step hook. When a fragment
``F`` syncs, its outer gradient is ``last[F] - mean over replicas of params[F]`` (every replica sends its
own ``last - params``, averaged by ``group``); DiLoCo sets ``params[F] = last[F]``, gives them that outer
gradient as ``.grad`` (other parameters get none, so the outer optimizer skips them; the inner gradients
are put back afterwards), steps the outer optimizer and sets ``last[F] = params[F]``.
The default outer optimizer is Nesterov SGD (lr 0.7, momentum 0.9: the paper's) over the model's own
parameters (``pp.optim.SGD`` for ``nn`` parameters, ``torch.optim.SGD`` for torch tensors); a given one
must be over exactly the parameters of ``model.parameters()``.

Schedule: the parameters (``model.parameters()``, in order) are cut into ``fragments`` contiguous pieces of
about equal element counts. A sync happens after inner steps ``s = j * H / fragments`` (``j = 1, 2, ...``),
and sync ``j`` covers fragment ``(j - 1) % fragments``: fragment ``f`` syncs after steps
``(f + 1) * H / k + m * H`` (``m = 0, 1, ...``), each fragment exactly once every ``H`` steps, one at a time.
``fragments`` must divide ``H``.

Overlap (``overlap=True``): a sync takes the outer gradient after step ``s`` and only starts its collective;
the result is applied after step ``s + 1`` (before a sync due then starts). The fragment's local progress in
that one step is kept: after the outer step the fragment becomes ``outer result + (params after s + 1 -
params after s)``, and ``last`` is the outer result, so that step counts toward the next sync.

``outer_dtype`` (``"bfloat16"``, ``"float16"``, ``"int8"``) compresses the outer gradient on the wire
(:mod:`~paramplane.parallel.diloco_comm` gives the bytes).

Wrappers: the model may be a ``pp.DDP`` / ``pp.FSDP`` whose own group lies inside a host; DiLoCo then works
on the wrapper's ``parameters()`` (for FSDP this rank's flat shards: every replica holds the same ranges, so
shard deltas average element by element). Their group may share no rank but this one with ``group``.

State: :meth:`state_dict` / :meth:`load_state_dict` (in memory) and :meth:`sharded_state_dict` /
:meth:`load_sharded_state_dict` (``pp.checkpoint``: ``last`` per parameter, FSDP shards as pieces of the
original parameters, the outer optimizer's state, the step count). Saving first applies a sync in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from paramplane.group import ProcessGroup
from paramplane.nn.module import Module
from paramplane.node.arrays import array_module
from paramplane.optim import SGD
from paramplane.optim.optimizer import Optimizer
from paramplane.parallel.ddp_buckets import broadcast_arrays
from paramplane.parallel.diloco_comm import WIRE_DTYPES, start_mean
from paramplane.parallel.diloco_recover import Undo, record_undo, rejoin
from paramplane.parallel.torch_params import is_torch_module, to_array, to_tensor

__all__ = ["DiLoCo"]


def _is_torch_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _cut(sizes: list[int], k: int) -> list[list[int]]:
    """Indices ``0..len(sizes)-1`` cut into ``k`` contiguous non-empty pieces of about equal total size."""
    total, acc, start = sum(sizes), 0, 0
    bounds: list[tuple[int, int]] = []
    for i, n in enumerate(sizes):
        acc += n
        left = len(sizes) - i - 1  # indices after i
        need = k - len(bounds) - 1  # cuts still to make after this one
        target = total * (len(bounds) + 1)  # times k: where the next cut should fall
        nearer = left > 0 and abs((acc + sizes[i + 1]) * k - target) >= abs(acc * k - target)
        if need > 0 and (acc * k >= target or nearer or left == need):
            bounds.append((start, i + 1))
            start = i + 1
    bounds.append((start, len(sizes)))
    return [list(range(a, b)) for a, b in bounds]


class _Pending:
    def __init__(
        self, fragment: int, waits: list[tuple[list[int], Callable[[], Any]]], snap: list[Any], number: int
    ) -> None:
        self.fragment, self.waits, self.snap, self.number = fragment, waits, snap, number


class DiLoCo:
    """Sync ``model``'s replicas over ``group`` every ``sync_every`` inner steps (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        inner_optimizer: Any,
        group: ProcessGroup,
        sync_every: int,
        outer_optimizer: Any = None,
        fragments: int = 1,
        overlap: bool = False,
        outer_dtype: str | None = None,
        *,
        init_sync: bool = True,
        alpha: float | None = None,
    ) -> None:
        """``init_sync`` broadcasts the parameters from group rank 0 (every replica must start equal; a
        collective every member joins); ``False`` when they are equal already (a checkpoint follows).
        ``alpha`` (with ``overlap``): how a late outer result merges with the local parameters; ``None`` keeps
        the local progress made meanwhile (outer result + local progress since the sync started), a float in
        [0, 1] gives ``alpha * local + (1 - alpha) * outer result`` (Streaming DiLoCo's mixing factor)."""
        if not isinstance(group, ProcessGroup):
            raise ValueError(f"DiLoCo needs a ProcessGroup of replicas, got {type(group).__name__}")
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(
                f"sync_every must be an int >= 1 (inner steps between syncs), got {sync_every!r}"
            )
        if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
            raise ValueError(f"fragments must be an int >= 1, got {fragments!r}")
        if sync_every % fragments:
            raise ValueError(
                f"fragments ({fragments}) must divide sync_every ({sync_every}): a fragment syncs every "
                f"sync_every / fragments steps in turn"
            )
        if outer_dtype not in WIRE_DTYPES:
            raise ValueError(f"outer_dtype must be one of {WIRE_DTYPES}, got {outer_dtype!r}")
        if alpha is not None and (not isinstance(alpha, int | float) or not 0.0 <= alpha <= 1.0):
            raise ValueError(f"alpha must be None or a float in [0, 1], got {alpha!r}")
        if alpha is not None and not overlap:
            raise ValueError("alpha mixes an overlapped sync's late result: it needs overlap=True")
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap must be a bool, got {overlap!r}")
        own = getattr(model, "group", None)
        if isinstance(own, ProcessGroup):
            me = own.ranks[own.rank]
            shared = sorted(set(own.ranks) & set(group.ranks))
            if shared != [me]:
                raise ValueError(
                    f"the wrapper's group {own.ranks} and DiLoCo's group {group.ranks} share ranks {shared}: "
                    "wrap the model over the ranks of one host (mesh.group('shard')) and give DiLoCo the "
                    "replicas across hosts (mesh.group('replicate'))"
                )
        elif not isinstance(model, Module) and not is_torch_module(model):
            raise ValueError(
                f"DiLoCo takes a paramplane.nn.Module, a torch.nn.Module or a pp.DDP / pp.FSDP wrapper, got "
                f"{type(model).__name__}"
            )
        named = [(n, p) for n, p in model.named_parameters() if getattr(p, "requires_grad", True)]
        if len(named) < fragments:
            raise ValueError(f"fragments={fragments} but the model has only {len(named)} parameters")
        self.model, self.group, self.inner_optimizer = model, group, inner_optimizer
        self.alpha = alpha
        self.sync_every, self.fragments, self.overlap, self.outer_dtype = (
            sync_every,
            fragments,
            overlap,
            outer_dtype,
        )
        self.keys = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._torch = _is_torch_tensor(self.params[0])
        self._layouts = self._find_layouts(model)
        self.fragment_indices = _cut(
            [int(np.prod(self._values(i).shape)) for i in range(len(self.params))], fragments
        )
        self.outer_optimizer = outer_optimizer if outer_optimizer is not None else self._default_outer()
        if self.outer_optimizer is inner_optimizer:
            raise ValueError("the outer optimizer must not be the inner optimizer: give DiLoCo a second one")
        self._check_outer()
        if init_sync and group.size > 1:
            broadcast_arrays(group, [self._values(i) for i in range(len(self.params))])
        self.last = [self._values(i).copy() for i in range(len(self.params))]
        self.step = 0
        self._started = 0  # the step whose sync last started
        self._pending: _Pending | None = None
        self.num_applied = 0  # syncs applied (sync j starts after inner step j * interval)
        self._undo: Undo | None = None  # how to take the last applied sync back (diloco_recover)
        if not hasattr(inner_optimizer, "register_step_post_hook"):
            raise ValueError(
                f"the inner optimizer must be a pp.optim or torch.optim optimizer, got {type(inner_optimizer).__name__}"
            )
        self._hook = inner_optimizer.register_step_post_hook(lambda *_: self._after_inner_step())

    # -- parameters ----------------------------------------------------------------------------------
    def _values(self, i: int) -> Any:
        p = self.params[i]
        return to_array(p.detach(), self.keys[i]) if self._torch else p.data

    def _find_layouts(self, model: Any) -> list[Any]:
        if not self._torch:
            return [getattr(p, "layout", None) for p in self.params]
        pieces = getattr(
            model, "optim_slots", None
        )  # a pp.FSDP: its parameters are pieces of module parameters
        slots = {id(t): cut for t, cut in pieces()} if pieces is not None else {}
        return [slots.get(id(p)) for p in self.params]

    def _default_outer(self) -> Any:
        if self._torch:
            import torch

            return torch.optim.SGD(self.params, lr=0.7, momentum=0.9, nesterov=True)
        return SGD(self.params, lr=0.7, momentum=0.9, nesterov=True)

    def _outer_params(self) -> list[Any]:
        opt = self.outer_optimizer
        if isinstance(opt, Optimizer):
            return list(opt.params)
        if hasattr(opt, "param_groups"):
            return [p for g in opt.param_groups for p in g["params"]]
        raise ValueError(
            f"outer_optimizer must be a pp.optim or torch.optim optimizer, got {type(opt).__name__}"
        )

    def _check_outer(self) -> None:
        theirs = {id(p) for p in self._outer_params()}
        if theirs != {id(p) for p in self.params}:
            raise ValueError(
                "the outer optimizer must be over exactly the model's parameters (model.parameters(); for "
                "pp.FSDP / pp.DDP the wrapper's)"
            )

    def _set_grad(self, i: int, value: Any) -> None:
        p = self.params[i]
        if self._torch and value is not None and not _is_torch_tensor(value):
            value = to_tensor(np.ascontiguousarray(value).reshape(p.shape))
        p.grad = value

    # -- the schedule --------------------------------------------------------------------------------
    @property
    def interval(self) -> int:
        """Inner steps between two syncs (of successive fragments): ``sync_every // fragments``."""
        return self.sync_every // self.fragments

    def fragment_names(self, f: int) -> list[str]:
        """The parameter names fragment ``f`` holds."""
        return [self.keys[i] for i in self.fragment_indices[f]]

    def _after_inner_step(self) -> None:
        self.step += 1
        self._sync_due()

    def _sync_due(self) -> None:
        """Apply a sync in flight, then start the one due after this step (if any). A sync whose collective
        fails (a lost replica: PlaneError) stays in ``_pending`` for :meth:`rejoin` to redo."""
        self.finish()
        if self.step % self.interval == 0 and self._started != self.step:
            self._pending = self._start(self.step // self.interval)
            self._started = self.step
            if not self.overlap:
                self.finish()

    def finish(self) -> None:
        """Apply an overlapped sync still in flight (at the end of training; saving calls it too)."""
        if self._pending is not None:
            self._apply(self._pending)  # waits first: a failed collective leaves everything as it was
            self._pending = None

    def sync_all(self) -> None:
        """Apply a sync in flight, then sync every fragment not synced after this very step, at once (a
        collective every replica calls): at the end of a streaming run every replica then holds the same
        model, as after DiLoCo's last sync with one fragment (the schedule's fragments each hold up to
        ``sync_every - interval`` steps of local progress otherwise)."""
        self.finish()
        just = (self.step // self.interval - 1) % self.fragments if self.step % self.interval == 0 else -1
        for f in range(self.fragments):
            if f != just or self._started != self.step:
                self._apply(self._start(0, fragment=f))

    def _start(
        self, number: int, base: list[Any] | None = None, *, keep: bool = False, fragment: int | None = None
    ) -> _Pending:
        """Start sync ``number`` (1, 2, ...; fragment ``(number - 1) % fragments``; 0: an extra one of
        ``fragment``): the mean of ``last - base`` (``base``: the fragment's current values). ``keep``:
        snapshot ``base`` even without overlap."""
        f = (number - 1) % self.fragments if fragment is None else fragment
        idx = self.fragment_indices[f]
        base = base if base is not None else [self._values(i) for i in idx]
        by_dtype: dict[Any, list[int]] = {}
        for i in idx:
            by_dtype.setdefault(self._values(i).dtype, []).append(i)
        waits = []
        at = {i: k for k, i in enumerate(idx)}
        for members in by_dtype.values():
            xp = array_module(self.last[members[0]])  # numpy or cupy
            flat = xp.concatenate([(self.last[i] - base[at[i]]).reshape(-1) for i in members])
            waits.append((members, start_mean(self.group, flat, self.outer_dtype)))
        snap = [b.copy() for b in base] if (self.overlap and number) or keep else []
        return _Pending(f, waits, snap, number)

    def _apply(self, pending: _Pending) -> None:
        idx = self.fragment_indices[pending.fragment]
        means: dict[int, Any] = {}
        for members, wait in pending.waits:
            flat, at = wait(), 0
            for i in members:
                n = int(self.last[i].size)
                means[i] = flat[at : at + n].reshape(self.last[i].shape)
                at += n
        drift = [self._values(i) - s for i, s in zip(idx, pending.snap, strict=True)] if pending.snap else []
        undo = record_undo(self, pending, drift)
        saved = [p.grad for p in self.params]
        try:
            for i in range(len(self.params)):
                self._set_grad(i, None)
            for i in idx:
                self._values(i)[...] = self.last[i]
                self._set_grad(i, means[i])
            self.outer_optimizer.step()
        finally:
            for p, g in zip(self.params, saved, strict=True):
                p.grad = g
        for k, i in enumerate(idx):
            self.last[i][...] = self._values(i)
            alpha = self.alpha
            if drift and alpha is None:
                self._values(i)[...] += drift[k]
            elif drift and alpha is not None:  # local = snap + drift
                local = pending.snap[k] + drift[k]
                self._values(i)[...] = alpha * local + (1.0 - alpha) * self._values(i)
                undo.drift[k] = self._values(i) - self.last[i]  # how far from last it was left
        if pending.number:  # not an extra sync (sync_all)
            self.num_applied, self._undo = pending.number, undo

    def rejoin(self, group: ProcessGroup | None = None, *, has_state: bool) -> int:
        """After ``world.reform()`` replaced lost replicas: every member of ``group`` (default: the same group,
        e.g. ``world.group``; pass a remade ``mesh.group("replicate")``, and ``fsdp.reform(mesh.group("shard"))``
        first) calls it, the replacements (made with ``init_sync=False``) with ``has_state=False``. Survivors
        that applied a sync others could not (a replica lost during its collective) roll it back; the lowest
        rank with state sends ``last``, the outer optimizer's state and the step count live; a replacement
        restarts from ``last``; every sync due and not applied is redone. Returns the step count (inner steps
        done) to resume the loop from. See :mod:`~paramplane.parallel.diloco_recover`."""
        return rejoin(self, group, has_state=has_state)

    def per_replica(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with each key suffixed by this replica's index (``"model"`` -> ``"model.replica1"``), for
        ``pp.checkpoint`` between syncs, where the replicas' modules and inner optimizers differ (under one
        key the save refuses them as replicas that disagree). The ranks of one replica get the same keys."""
        return {f"{key}.replica{self.group.rank}": value for key, value in state.items()}

    def remove(self) -> None:
        """Stop syncing (unregister the inner optimizer's hook)."""
        self._hook.remove()

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"step", "last": {name: copy}, "outer": outer_optimizer.state_dict()}`` (in memory)."""
        self.finish()
        return {
            "step": self.step,
            "last": {k: a.copy() for k, a in zip(self.keys, self.last, strict=True)},
            "outer": self.outer_optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"step", "last", "outer"} or set(state["last"]) != set(self.keys):
            raise ValueError(
                "DiLoCo.load_state_dict takes what DiLoCo.state_dict returned for the same model"
            )
        for key, a in zip(self.keys, self.last, strict=True):
            a[...] = np.asarray(state["last"][key]).reshape(a.shape)
        self.outer_optimizer.load_state_dict(state["outer"])
        self.step = self._started = int(state["step"])
        self._pending, self._undo, self.num_applied = None, None, self.step // self.interval

    def sharded_state_dict(self) -> dict[str, Any]:
        """For ``pp.checkpoint``: ``step``, ``last.<param>`` and ``outer.<key>`` (live views: a loader writes
        into them). FSDP shards appear as pieces of the original parameters, so they reshard."""
        from paramplane.parallel.diloco_state import sharded_state_dict

        return sharded_state_dict(self)

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Take the step count and the outer optimizer's hyper-parameters (arrays were loaded in place)."""
        self._pending, self._undo = None, None
        self.step = self._started = int(state["step"])
        self.num_applied = self.step // self.interval
        if isinstance(self.outer_optimizer, Optimizer):
            self.outer_optimizer.load_sharded_state_dict(
                {k[len("outer.") :]: v for k, v in state.items() if k.startswith("outer.")}
            )

    def __repr__(self) -> str:
        return (
            f"DiLoCo(sync_every={self.sync_every}, fragments={self.fragments}, overlap={self.overlap}, "
            f"outer_dtype={self.outer_dtype}, replicas={self.group.size}, params={len(self.params)})"
        )
