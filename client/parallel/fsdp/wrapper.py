"""``FSDP``: fully sharded data parallelism (ZeRO) over explicit-backward modules.

Usage::

    fsdp = pp.FSDP(model, world.group, strategy="full_shard")
    opt = pp.optim.AdamW(fsdp.parameters(), lr=1e-3)    # this rank's flat shards: optimizer state is sharded
    fsdp.attach(opt)                                     # opt.step() first waits for the gradient sync
    loss = crit(fsdp(x_shard), y_shard)
    fsdp.backward(crit.backward())
    opt.step()

Every strategy is one algorithm over a ``("replicate", "shard")`` mesh of the group:
parameters are sharded over the shard group (size S) and replicated over the replicate
group (size R). full_shard and shard_grad_op use S = N; no_shard uses S = 1 (DDP-like);
hybrid_shard and hybrid_shard_zero2 use S = ``intra_size`` (default: ranks per host).
A unit's flat parameter is all-gathered over the shard group before its forward and
(when resharded after forward: full_shard, hybrid_shard) again before its backward.
After its backward the unit's flat gradient is reduce-scattered over the shard group at
once (async, overlapping the rest of the backward), and its shard all-reduced over the
replicate group. Gradients are averaged over all N ranks, so equal batch shards and a
mean loss reproduce one process on the whole batch. ``comm_dtype="bfloat16"`` (or ``"float16"``)
compresses that replicate all-reduce (HybridShard's inter-host traffic) like torch's compress hooks:
half the bytes between hosts, at that dtype's precision (on cupy use float16); the reduce-scatter inside a
host is unchanged.

The wrapper composes the pieces of this package: the strategy's groups (``config.ShardingStrategy``), the
flat units (``units.py``), their all-gathers and prefetch order (``gather.Gatherer``), their gradient
reductions (``reduce.Reducer``), the state dicts (``state.py``) and a module path: ``nn_path.NNPath`` for a
``paramplane.nn.Module``, ``torch_adapter.TorchPath`` for a ``torch.nn.Module``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

import numpy as np

from paramplane.group import ProcessGroup
from paramplane.nn.module import Array, LoadResult, Module, RemovableHandle
from paramplane.node.arrays import DTYPES, array_module
from paramplane.optim.optimizer import Optimizer
from paramplane.parallel.ddp_buckets import COMM_DTYPES, broadcast_arrays
from paramplane.parallel.fsdp import fsdp1_args, fsdp1_static, fsdp2_methods, optim_full
from paramplane.parallel.fsdp import state as fsdp_state
from paramplane.parallel.fsdp.config import (
    STRATEGIES,
    CPUOffload,
    MemoryTracker,
    MixedPrecision,
    ShardingStrategy,
)
from paramplane.parallel.fsdp.gather import Gatherer
from paramplane.parallel.fsdp.nn_path import ModulePath, NNPath
from paramplane.parallel.fsdp.optim_state import TorchOptimState
from paramplane.parallel.fsdp.reduce import Reducer
from paramplane.parallel.fsdp.torch_adapter import TorchPath
from paramplane.parallel.fsdp.units import (
    FlatUnit,
    UnitsByClass,
    build_units,
    check_same_model,
    units_by_class,
)
from paramplane.parallel.sharding import ShardedArray
from paramplane.parallel.torch_params import (
    TorchModule,
    is_torch_module,
    is_wrapper,
    module_attribute,
    refuse_copy,
    refuse_wrapper,
    wrapper_group,
)

__all__ = ["FSDP", "STRATEGIES", "CPUOffload", "MixedPrecision", "TorchFSDP", "units_by_class"]


class FSDP:
    """Shard ``module``'s parameters, gradients and optimizer state over ``group`` (module docstring).

    A ``torch.nn.Module`` (CPU tensors) is wrapped by :class:`TorchFSDP`, the same algorithm driven by
    torch's module and autograd hooks (:mod:`~paramplane.parallel.fsdp.torch_adapter`).

    torch FSDP1's keywords are taken too (:mod:`~paramplane.parallel.fsdp.fsdp1_args`): ``process_group`` for
    ``group`` (one group: HYBRID_SHARD's (intra, inter) pair is ``intra_size`` here), ``sharding_strategy``
    (torch's ``ShardingStrategy``) for ``strategy``, ``auto_wrap_policy`` (torch's policies) for ``units``,
    ``backward_prefetch`` as torch's ``BackwardPrefetch``, ``cpu_offload`` as torch's ``CPUOffload``,
    ``device_id`` (the module moves there first), ``limit_all_gathers`` and ``device_mesh`` (a torch DeviceMesh
    over paramplane's torch.distributed backend: 1-D, or 2-D (replicate, shard) for HYBRID_SHARD, whose shard
    size is then ``intra_size``); ``ignored_modules``, ``ignored_states`` and ``param_init_fn`` are refused.
    """

    WRAPS_A_MODULE: ClassVar[bool] = True

    def __reduce_ex__(self, protocol: Any) -> Any:
        refuse_copy(self)

    def __new__(cls, module: Any, *args: Any, **kwargs: Any) -> FSDP:
        if cls is FSDP and is_torch_module(module) and not is_wrapper(module):
            return cast(FSDP, super().__new__(TorchFSDP))
        return super().__new__(cls)

    def __init__(
        self,
        module: Module | TorchModule,
        group: ProcessGroup | None = None,
        strategy: str = "full_shard",
        *,
        process_group: ProcessGroup | None = None,
        units: Sequence[Module] | UnitsByClass | None = None,
        intra_size: int | None = None,
        cpu_offload: bool | CPUOffload = False,
        mixed_precision: MixedPrecision | Any = None,
        forward_prefetch: bool = True,
        backward_prefetch: str | None = "pre",
        reshard_after_forward: bool | None = None,
        sync_module_states: bool = True,
        comm_dtype: str | None = None,
        use_orig_params: bool = False,
        sharding_strategy: Any = None,
        auto_wrap_policy: Any = None,
        device_id: Any = None,
        limit_all_gathers: bool = True,
        ignored_modules: Any = None,
        ignored_states: Any = None,
        param_init_fn: Any = None,
        device_mesh: Any = None,
    ) -> None:
        refuse_wrapper(module, "FSDP")
        if not isinstance(module, Module) and not is_torch_module(module):
            raise ValueError(
                f"FSDP wraps a paramplane.nn.Module or a torch.nn.Module, got {type(module).__name__}"
            )
        group = wrapper_group("FSDP", group, process_group, device_mesh, hybrid=True)
        # FSDP1's cap on gathers in flight: prefetching here holds one unit ahead at most
        del limit_all_gathers
        strategy, units, backward_prefetch = fsdp1_args.translate(
            module,
            strategy,
            units,
            backward_prefetch,
            sharding_strategy=sharding_strategy,
            auto_wrap_policy=auto_wrap_policy,
            device_id=device_id,
            torch_module=is_torch_module(module),
            unsupported={
                "ignored_modules": ignored_modules,
                "ignored_states": ignored_states,
                "param_init_fn": param_init_fn,
            },
        )
        if getattr(device_mesh, "ndim", 1) == 2:  # FSDP1's HYBRID_SHARD mesh: (replicate, shard)
            if not strategy.startswith("hybrid"):
                raise ValueError(f"FSDP: a 2-D device_mesh is for a hybrid strategy, not {strategy!r}")
            if intra_size not in (None, device_mesh.size(1)):
                raise ValueError(f"FSDP: intra_size={intra_size} disagrees with the device_mesh's shard size")
            intra_size = int(device_mesh.size(1))
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
        if comm_dtype not in COMM_DTYPES:
            raise ValueError(f"comm_dtype must be one of {COMM_DTYPES}, got {comm_dtype!r}")
        if mixed_precision is not None:
            mixed_precision = MixedPrecision.of(mixed_precision)
        if use_orig_params and not is_torch_module(module):
            raise ValueError(
                "use_orig_params applies to torch modules (a paramplane.nn optimizer steps the shards)"
            )
        path: ModulePath = (
            TorchPath(module, self, use_orig_params) if is_torch_module(module) else NNPath(module, self)
        )
        self._path = path
        named = path.trainable()
        if not named:
            raise ValueError(
                f"FSDP: {type(module).__name__} has no trainable parameters to shard (pp.FSDP keeps frozen "
                "parameters whole on every rank unless use_orig_params=True shards them too): pass "
                "use_orig_params=True to shard a frozen model (a teacher, a reference model), or use it unwrapped"
            )
        offload = fsdp1_args.cpu_offload_of(cpu_offload)
        self._xp = array_module(named[0][1].data)
        if any(array_module(p.data) is not self._xp for _, p in named):
            raise ValueError("FSDP: the module mixes numpy and cupy parameters; move it to one device first")
        host_shards = offload.params and self._xp is not np
        self.module = module
        self.group = group
        self.strategy = strategy
        self.offload = offload
        self.forward_prefetch = forward_prefetch
        self.backward_prefetch = backward_prefetch
        self._sharding = ShardingStrategy.resolve(strategy, group, intra_size, reshard_after_forward)
        self.reshard_after_forward = self._sharding.reshard_after_forward
        self.mesh, self.shard_group, self.replicate_group = self._sharding.groups(group)
        master = named[0][1].dtype
        self.master_dtype = master
        mp = mixed_precision or MixedPrecision()
        self.param_dtype = np.dtype(mp.param_dtype) if mp.param_dtype is not None else master
        self.reduce_dtype = np.dtype(mp.reduce_dtype) if mp.reduce_dtype is not None else self.param_dtype
        self.output_dtype = np.dtype(mp.output_dtype) if mp.output_dtype is not None else None
        self.comm_dtype = np.dtype(DTYPES[comm_dtype]) if comm_dtype is not None else None
        self.units: list[FlatUnit] = []
        self._state_dict_settings: Any = None  # set_state_dict_type's (FULL_STATE_DICT's configs)
        self.memory = MemoryTracker(self._lasting_bytes)
        self._named = named
        check_same_model(group, named)
        groups = path.unit_groups(named, units)
        self.units = build_units(
            groups, group, self.shard_group, master, sync=sync_module_states, host_shards=host_shards
        )
        path.adopt(self.units)
        if sync_module_states and group.size > 1:  # replicated state too: frozen parameters and buffers
            broadcast_arrays(group, [a for _, a in [*path.frozen(), *path.buffers()]])
        self._gather = Gatherer(
            self.units,
            self.shard_group,
            self._xp,
            self.param_dtype,
            self.memory,
            forward_prefetch=forward_prefetch,
        )
        self._reducer = Reducer(
            group,
            self.shard_group,
            self.replicate_group,
            self._gather,
            self.memory,
            reduce_dtype=self.reduce_dtype,
            master_dtype=master,
            comm_dtype=self.comm_dtype,
            host_shards=host_shards,
        )
        self._wrapped = self._gather.wrapped
        self._root = self._gather.root
        for u in self._wrapped:
            path.wrap(u)
        path.wrap_root(self.units)
        self._forward_open = False
        self._summoned = False
        """Inside ``summon_full_params``: every unit is whole, and a forward gathers and reshards nothing."""
        self.memory.update()

    def reform(self, group: ProcessGroup | None = None) -> None:
        """Go on after ``world.reform()`` (this FSDP's group is ``world.group``, now over the new world; an FSDP
        over a group made from the old world, e.g. ``mesh.group("shard")``, takes the one remade from the new
        world as ``group``: same ranks, same place in the mesh).

        Drops what the failed step left in flight (gathered parameters, pending reductions, gradients),
        makes the shard and replicate groups again and checks the model across the group: the collectives
        a replacement's ``FSDP(..., sync_module_states=False)`` runs at the same time. Then bring the
        replacement up to date with ``pp.checkpoint.sync({"model": fsdp, "optim": opt, ...},
        fsdp.replicate_group, has_state=True)``: its replicas hold the same shards (hybrid strategies and
        no_shard); with full_shard or shard_grad_op its shards are gone, so load a checkpoint instead.
        """
        if group is not None:
            if not isinstance(group, ProcessGroup) or group.ranks != self.group.ranks:
                raise ValueError(
                    f"FSDP.reform(group) takes the remade group over the same ranks {self.group.ranks}, got "
                    f"{getattr(group, 'ranks', group)!r}"
                )
            self.group = group
        for unit in self.units:
            self._reducer.drop(unit)
            unit.gather_work = None
            self._gather.release(unit)
            unit.drop_param_grads()
            unit.shard.grad = None
        self._reducer.reset()
        self._forward_open = False
        self.mesh, self.shard_group, self.replicate_group = self._sharding.groups(self.group)
        self._gather.reset(self.shard_group)
        self._reducer.set_groups(self.shard_group, self.replicate_group)
        check_same_model(self.group, self._named)
        self.memory.update()

    def _mark(self, name: str, start: float) -> None:
        tracer = self.group.tracer
        if tracer is not None and hasattr(tracer, "mark"):
            tracer.mark(f"fsdp {name}", start, time.monotonic())

    # -- forward / backward ------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module; each unit is gathered when it is used (and the next one prefetched).

        A ``paramplane.nn`` module takes one input ``x``: with mixed precision a floating-point ``x`` is cast
        to ``param_dtype`` (the compute dtype); the output is cast to ``output_dtype`` when one is set. A torch
        module takes its own arguments (floating-point tensors cast to ``param_dtype``).
        """
        return self._path.forward(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    if not TYPE_CHECKING:  # (hidden from mypy, which would otherwise accept any attribute of an FSDP)

        def __getattr__(self, name: str) -> Any:
            """A torch module's attributes the wrapper lacks (``torch_params.module_attribute``):
            ``fsdp.generate(...)`` runs the module's forward, which gathers as ``fsdp(...)`` does."""
            return module_attribute(self, name)

    def backward(self, grad_out: Array) -> Array:
        """Run the module's backward; each unit's gradient reduce-scatter starts as soon as it is ready.

        (A torch module runs torch's backward instead: ``loss.backward()``.)"""
        return cast(Array, self._path.backward(grad_out))

    def finish_gradient_sync(self) -> None:
        """Wait for every gradient reduction and set each shard's ``grad`` (averaged over the group).

        A no-op when no synchronised backward ran since the last call, but for waiting for and dropping
        pending prefetched gathers (they read the shards, which an optimizer step changes next).
        """
        self._path.before_grad_sync(self.units)
        self._reducer.finish()
        self._path.after_grad_change(self.units)

    def attach(self, optimizer: Any) -> RemovableHandle:
        """Make ``optimizer.step()`` call :meth:`finish_gradient_sync` first; returns the hook handle.

        A ``paramplane.optim`` optimizer for a paramplane module, a ``torch.optim`` one for a torch module
        (optional there: a synchronised backward finishes the sync itself)."""
        return self._path.attach(optimizer)

    def optim_state(self, optimizer: Any, *, state_arrays: tuple[str, ...] | None = None) -> Any:
        """What to checkpoint for ``optimizer`` (over this FSDP's ``parameters()``), resharding like the model:
        a ``paramplane.optim`` optimizer is checkpointable itself; a ``torch.optim`` one is wrapped
        (``optim_state.TorchOptimState``; ``state_arrays`` names its state tensors where paramplane does not
        know them), like torch FSDP's ``optim_state_dict``: ``pp.checkpoint.save({"model": fsdp, "optim":
        fsdp.optim_state(opt)}, ...)``."""
        if isinstance(optimizer, Optimizer):
            return optimizer
        return TorchOptimState(optimizer, self.optim_slots(), state_arrays)

    def optim_slots(self) -> list[tuple[Any, Any]]:
        """Each parameter ``parameters()`` hands an optimizer, with the cut of an array shaped like it (its
        optimizer state) into ``ShardedArray``s of module parameters by name: what resharding checkpoints of
        optimizer state (``optim_state``, ``pp.DiLoCo``) are built from."""
        return self._path.optim_slots(self.units)

    def optim_state_dict(self, optim: Any, optim_state_dict: Any = None, group: Any = None) -> dict[str, Any]:
        """torch FSDP1's ``FSDP.optim_state_dict(model, optim)``: the torch optimizer's full state keyed by
        parameter name (tensors shaped like the parameters, CPU, on every rank), for ``torch.save``; a
        collective. ``optim_state_dict`` and ``group`` are torch's and must be None (the state is read from
        ``optim``, the group is the FSDP's). See :mod:`~paramplane.parallel.fsdp.optim_full`."""
        if optim_state_dict is not None or group is not None:
            raise ValueError("FSDP.optim_state_dict: optim_state_dict= and group= are not supported")
        return optim_full.full_optim_state_dict(self, optim)

    def optim_state_dict_to_load(
        self,
        optim: Any,
        optim_state_dict: dict[str, Any],
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: Any = None,
    ) -> dict[str, Any]:
        """torch FSDP1's ``FSDP.optim_state_dict_to_load(model, optim, osd)``: what ``optim_state_dict`` gave
        (saved at any world size or strategy) as this rank's ``optim.load_state_dict`` argument;
        ``load_directly=True`` loads it too. No communication. torch's ``is_named_optimizer`` and ``group``
        must keep their defaults."""
        if is_named_optimizer or group is not None:
            raise ValueError("FSDP.optim_state_dict_to_load: is_named_optimizer and group= are not supported")
        result = optim_full.optim_state_dict_to_load(self, optim, optim_state_dict)
        if load_directly:
            optim.load_state_dict(result)
        return result

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate full gradients locally, without communication (like torch)."""
        previous, self._reducer.no_sync = self._reducer.no_sync, True
        try:
            yield
        finally:
            self._reducer.no_sync = previous

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's switch for accumulation: False makes the backwards that follow accumulate full gradients
        locally, as inside ``no_sync()``; set it True before the last micro-step's backward. ``recurse`` is
        FSDP2's keyword (its units are modules of their own): here it is always every unit."""
        if not isinstance(requires_gradient_sync, bool):
            raise ValueError(f"requires_gradient_sync must be a bool, got {requires_gradient_sync!r}")
        self._reducer.no_sync = not requires_gradient_sync

    # FSDP2's FSDPModule methods (fsdp2_methods.py)
    unshard = fsdp2_methods.unshard
    reshard = fsdp2_methods.reshard
    set_gradient_divide_factor = fsdp2_methods.set_gradient_divide_factor
    set_reshard_after_forward = fsdp2_methods.set_reshard_after_forward
    set_reshard_after_backward = fsdp2_methods.set_reshard_after_backward
    set_is_last_backward = fsdp2_methods.set_is_last_backward
    set_modules_to_forward_prefetch = fsdp2_methods.set_modules_to_forward_prefetch
    set_modules_to_backward_prefetch = fsdp2_methods.set_modules_to_backward_prefetch

    # -- gradients ---------------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Any:
        """Scale the shards' gradients so the global norm is at most ``max_norm``; returns the norm.

        The norm is of the full gradient (each element counted once), the same on every rank (for a torch
        module, a tensor, as torch's FSDP1 returns it). ``torch.nn.utils.clip_grad_norm_(fsdp.parameters(),
        c)`` would use this rank's shards only.
        """
        if norm_type not in (2.0, math.inf):
            raise ValueError(f"norm_type must be 2.0 or math.inf, got {norm_type!r}")
        self.finish_gradient_sync()
        grads = [u.shard.grad for u in self.units if u.shard.grad is not None]
        xp = array_module(self.units[0].shard.data)
        if norm_type == 2.0:
            local = sum((float((g.astype(np.float64) ** 2).sum()) for g in grads), 0.0)
        else:
            local = max((float(xp.abs(g).max()) for g in grads if g.size), default=0.0)
        total = np.array([local], np.float64)
        if self.shard_group.size > 1:  # replicas hold equal shards: reduce over the shard group only
            self.shard_group.all_reduce(total, "sum" if norm_type == 2.0 else "max")
        norm = float(np.sqrt(total[0])) if norm_type == 2.0 else float(total[0])
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                g *= coef
        return self._path.norm(norm)

    # -- inspection --------------------------------------------------------------------------------
    def parameters(self, recurse: bool = True) -> Iterator[Any]:
        """This rank's flat shards (what an optimizer should step; torch Parameters for a torch module, one
        piece per original parameter with ``use_orig_params``); an iterator, as torch's (take a ``list`` to
        use them twice). ``recurse`` is torch's argument: every unit's shards are the wrapper's."""
        return (p for _, p in self.named_parameters(recurse=recurse))

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Any]]:
        """(name, shard) for ``parameters()``; torch's arguments: ``prefix`` goes before each name, and
        ``recurse`` and ``remove_duplicate`` change nothing (every unit's shards, none twice)."""
        del recurse, remove_duplicate
        dot = prefix + "." if prefix else ""
        return ((dot + n, p) for n, p in self._path.named_parameters(self.units))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for unit in self.units:
            if set_to_none:
                unit.shard.grad = None
            elif unit.shard.grad is not None:
                unit.shard.grad[...] = 0
            unit.drop_param_grads()
        self._path.after_grad_change(self.units)
        self.memory.update()

    def train(self, mode: bool = True) -> FSDP:
        self.module.train(mode)
        return self

    def eval(self) -> FSDP:
        return self.train(False)

    def memory_stats(self) -> dict[str, Any]:
        """Measured bytes per kind (``current`` and ``peak`` since ``reset_peak``) and the analytic estimate;
        for cupy models also ``device_pool``: the bytes cupy's default memory pool uses and holds."""
        stats: dict[str, Any] = self.memory.snapshot()
        total = sum(u.numel for u in self.units)
        item = self.master_dtype.itemsize
        stats["estimate"] = {
            "total_params": total,
            "param_memory_bytes": total * item // self.shard_group.size,
            "grad_memory_bytes": total * item // self.shard_group.size,
            "optim_memory_bytes": 2 * total * item // self.shard_group.size,
            "world_size": self.group.size,
        }
        if self._xp is not np:  # cupy: what its memory pool holds (all of this process's cupy arrays)
            pool = self._xp.get_default_memory_pool()
            stats["device_pool"] = {"used": int(pool.used_bytes()), "total": int(pool.total_bytes())}
        return stats

    def reset_peak(self) -> None:
        self.memory.reset_peak()

    def _lasting_bytes(self) -> dict[str, int]:
        """Shards, their gradients (and unsharded ones accumulated under no_sync) and optimizer state."""
        grads = sum(int(u.shard.grad.nbytes) for u in self.units if u.shard.grad is not None)
        grads += sum(int(p.grad.nbytes) for u in self.units for p in u.params if p.grad is not None)
        return {
            "params_sharded": sum(int(u.shard.data.nbytes) for u in self.units),
            "grads": grads,
            "optim_state": self._path.optim_bytes(),
        }

    # -- state (state.py; the module path adds its keys and values) -----------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The full, unsharded state (same keys as ``module.state_dict()``), on every rank; for a torch
        module CPU torch tensors: ``plain.load_state_dict(fsdp.state_dict(), strict=True)`` loads it."""
        return self._path.state_dict(fsdp_state.full_values(self.units, self.shard_group, self.master_dtype))

    # torch FSDP1's static methods (fsdp1_static.py)
    state_dict_type = staticmethod(fsdp1_static.state_dict_type)
    set_state_dict_type = staticmethod(fsdp1_static.set_state_dict_type)
    get_state_dict_type = staticmethod(fsdp1_static.get_state_dict_type)
    full_optim_state_dict = staticmethod(fsdp1_static.full_optim_state_dict)
    shard_full_optim_state_dict = staticmethod(fsdp1_static.shard_full_optim_state_dict)
    scatter_full_optim_state_dict = staticmethod(fsdp1_static.scatter_full_optim_state_dict)
    rekey_optim_state_dict = staticmethod(fsdp1_static.rekey_optim_state_dict)
    fsdp_modules = staticmethod(fsdp1_static.fsdp_modules)

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> LoadResult:
        """Load a full state dict (``module.state_dict()``'s keys): every rank keeps its shard (no
        communication). As torch's: ``strict=False`` loads the keys present, keeps the others and returns the
        keys skipped (``missing_keys``, ``unexpected_keys``); ``strict=True`` raises a ValueError naming them."""
        full, skipped = self._path.canonical_state(state, strict)
        loaded = fsdp_state.load_full(
            self.units,
            full,
            self._path.replicated(),
            self._gather,
            self.master_dtype,
            self.shard_group.rank,
            strict,
        )
        return skipped if skipped is not None else loaded

    def sharded_state_dict(self) -> dict[str, ShardedArray | Any]:
        """This rank's pieces as ``ShardedArray`` views into the live shards (under every state-dict key: a
        tied alias shares its owner's pieces), plus frozen parameters and buffers (replicated, whole arrays).

        Replicas (no_shard, hybrid) hold equal ranges; a writer keeps one of them.
        """
        return self._path.add_aliases(fsdp_state.sharded_views(self.units, self._path.replicated()))

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Copy ``state`` (as returned by :meth:`sharded_state_dict`, possibly refilled) into the shards."""
        self._gather.discard_prefetches()
        fsdp_state.load_sharded(self.sharded_state_dict(), state)

    @contextlib.contextmanager
    def summon_full_params(
        self,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Iterator[None]:
        """Full parameters (master dtype) in the module inside; writes are kept (``writeback=False``: dropped);
        resharded after (a collective on entry and exit). Inside, a torch module's forward under
        ``torch.no_grad()`` runs on the full parameters without gathering, on any rank alone: ``if rank == 0:
        fsdp.module.generate(...)``; ``module.state_dict()`` holds the full values. torch FSDP1's call shape
        (``pp.FSDP.summon_full_params(fsdp, writeback=False)`` too): ``recurse`` is taken (every unit is
        summoned), ``rank0_only`` gives every rank the full parameters (with ``writeback=False``, as torch's
        requires), ``offload_to_cpu`` keeps them where the shards are; ``with_grads`` is not supported."""
        if with_grads:
            raise ValueError(
                "FSDP.summon_full_params(with_grads=True) is not supported: gradients stay sharded"
            )
        if rank0_only and writeback:
            raise ValueError("FSDP.summon_full_params: rank0_only=True needs writeback=False (as torch's)")
        if self._summoned:
            raise RuntimeError("FSDP.summon_full_params() is already active")
        del recurse, offload_to_cpu
        with fsdp_state.summon_full_params(
            self.units, self._gather, self.master_dtype, self._xp, self.finish_gradient_sync, writeback
        ):
            self._summoned = True
            try:
                yield
            finally:
                self._summoned = False

    def __repr__(self) -> str:
        return (
            f"FSDP({type(self.module).__name__}, strategy={self.strategy}, units={len(self.units)}, "
            f"shard={self.shard_group.size}, replicate={self.replicate_group.size})"
        )


class TorchFSDP(FSDP):
    """``pp.FSDP(torch_module, group, ...)``: the wrapper with a ``TorchPath`` (see
    :mod:`~paramplane.parallel.fsdp.torch_adapter`); the arguments are FSDP's.

    ``cpu_offload`` changes nothing (the tensors are in host memory already); ``mixed_precision`` gathers
    and computes in ``param_dtype`` (the forward's floating-point inputs are cast to it) and reduces in
    ``reduce_dtype``, with float32 (or float64) master shards.
    """

    def reduce_accumulated_gradients(self) -> None:
        """Reduce the gradients accumulated under ``no_sync`` now, as the next synchronised backward would
        (each unit's full gradient reduce-scattered and averaged over the group into its shard's ``grad``),
        without running one: how a pipeline (``pp.Pipeline``) reduces once per global batch after the last
        microbatch's backward, the role of torch FSDP2's ``set_requires_gradient_sync`` there."""
        cast(TorchPath, self._path).reduce_accumulated()
