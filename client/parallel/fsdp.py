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
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any, cast

import numpy as np

from paramplane.group import ProcessGroup
from paramplane.nn.layers import Sequential
from paramplane.nn.module import Array, Module, Parameter, RemovableHandle
from paramplane.node.arrays import DTYPES, array_module, is_floating, to_host, to_pinned
from paramplane.optim.optimizer import Optimizer
from paramplane.parallel.ddp import broadcast_arrays
from paramplane.parallel.ddp_buckets import COMM_DTYPES
from paramplane.parallel.fsdp_config import STRATEGIES, CPUOffload, MemoryTracker, MixedPrecision
from paramplane.parallel.fsdp_prefetch import FSDPPrefetch
from paramplane.parallel.fsdp_units import (
    FlatUnit,
    UnitsByClass,
    check_same_model,
    concat_params,
    units_by_class,
)
from paramplane.parallel.mesh import Mesh
from paramplane.parallel.torch_params import is_torch_module

__all__ = ["FSDP", "STRATEGIES", "CPUOffload", "MixedPrecision", "units_by_class"]


class FSDP(FSDPPrefetch):
    """Shard ``module``'s parameters, gradients and optimizer state over ``group`` (module docstring).

    A ``torch.nn.Module`` (CPU tensors) is wrapped by :class:`~paramplane.parallel.fsdp_torch.TorchFSDP`,
    the same algorithm driven by torch's module and autograd hooks.
    """

    def __new__(cls, module: Any, *args: Any, **kwargs: Any) -> FSDP:
        if cls is FSDP and is_torch_module(module):
            from paramplane.parallel.fsdp_torch import TorchFSDP

            return cast(FSDP, super().__new__(TorchFSDP))
        return super().__new__(cls)

    def __init__(
        self,
        module: Module,
        group: ProcessGroup,
        strategy: str = "full_shard",
        *,
        units: Sequence[Module] | UnitsByClass | None = None,
        intra_size: int | None = None,
        cpu_offload: bool | CPUOffload = False,
        mixed_precision: MixedPrecision | None = None,
        forward_prefetch: bool = True,
        backward_prefetch: str | None = "pre",
        reshard_after_forward: bool | None = None,
        sync_module_states: bool = True,
        comm_dtype: str | None = None,
    ) -> None:
        if not isinstance(module, Module) and not is_torch_module(module):
            raise ValueError(
                f"FSDP wraps a paramplane.nn.Module or a torch.nn.Module, got {type(module).__name__}"
            )
        if not isinstance(group, ProcessGroup):
            raise ValueError(f"FSDP needs a ProcessGroup, got {type(group).__name__}")
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
        if backward_prefetch not in ("pre", "post", None):
            raise ValueError(f"backward_prefetch must be 'pre', 'post' or None, got {backward_prefetch!r}")
        if comm_dtype not in COMM_DTYPES:
            raise ValueError(f"comm_dtype must be one of {COMM_DTYPES}, got {comm_dtype!r}")
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise ValueError("mixed_precision must be a pp.MixedPrecision")
        named = self._trainable(module)
        if not named:
            raise ValueError(f"FSDP: {type(module).__name__} has no trainable parameters to shard")
        offload = cpu_offload if isinstance(cpu_offload, CPUOffload) else CPUOffload(bool(cpu_offload))
        self._xp = array_module(named[0][1].data)
        if any(array_module(p.data) is not self._xp for _, p in named):
            raise ValueError("FSDP: the module mixes numpy and cupy parameters; move it to one device first")
        self._host_shards = offload.params and self._xp is not np
        self.module = module
        self.group = group
        self.strategy = strategy
        self.offload = offload
        self.forward_prefetch = forward_prefetch
        self.backward_prefetch = backward_prefetch
        hybrid = strategy.startswith("hybrid")
        self.reshard_after_forward = (
            reshard_after_forward
            if reshard_after_forward is not None
            else strategy in ("full_shard", "hybrid_shard")
        )
        shard_size = self._shard_size(strategy, intra_size, hybrid)
        self._make_groups(shard_size)
        master = named[0][1].dtype
        self.master_dtype = master
        mp = mixed_precision or MixedPrecision()
        self.param_dtype = np.dtype(mp.param_dtype) if mp.param_dtype is not None else master
        self.reduce_dtype = np.dtype(mp.reduce_dtype) if mp.reduce_dtype is not None else self.param_dtype
        self.output_dtype = np.dtype(mp.output_dtype) if mp.output_dtype is not None else None
        self.comm_dtype = np.dtype(DTYPES[comm_dtype]) if comm_dtype is not None else None
        # float16 mean: divide before the sum (which could overflow), as the engine's float16 mean does
        self._predivide = np.dtype(np.float16) in (self.reduce_dtype, self.comm_dtype)
        self._optimizer: Optimizer | None = None
        self.units: list[FlatUnit] = []
        self.memory = MemoryTracker(self._lasting_bytes)
        self._named = named
        check_same_model(group, named)
        self.units = self._build_units(module, named, units, sync_module_states)
        if sync_module_states and group.size > 1:  # replicated state too: frozen parameters and buffers
            broadcast_arrays(group, [a for _, a in [*self._frozen(), *self._buffers()]])
        self._order = {id(u): i for i, u in enumerate(self.units)}
        self._wrapped = [u for u in self.units if u.module is not None]
        self._root = next((u for u in self.units if u.module is None), None)
        self._originals: list[tuple[Module, Any, Any]] = []
        for u in self._wrapped:
            self._wrap(u)
        self._init_order()
        self._no_sync = False
        self._round_open = False
        self._forward_open = False
        self._reduce_queue: list[FlatUnit] = []
        self.memory.update()

    # -- construction ------------------------------------------------------------------------------
    def _trainable(self, module: Module) -> list[tuple[str, Parameter]]:
        return [(n, p) for n, p in module.named_parameters() if p.requires_grad]

    def _children(self, module: Module) -> list[tuple[str, Module]]:
        """The default units: the children with parameters of a Sequential (or of a module with several)."""
        children = [(n, m) for n, m in module.named_children() if m.parameters()]
        return children if isinstance(module, Sequential) or len(children) > 1 else []

    def _members(self, module: Module) -> list[Parameter]:
        return module.parameters()

    def _make_groups(self, shard_size: int) -> None:
        group = self.group
        self.mesh = Mesh(group, dims=[("replicate", group.size // shard_size), ("shard", shard_size)])
        self.shard_group = self.mesh.group("shard")
        self.replicate_group = self.mesh.group("replicate")

    def reform(self) -> None:
        """Go on after ``world.reform()`` (this FSDP's group is ``world.group``, now over the new world).

        Drops what the failed step left in flight (gathered parameters, pending reductions, gradients),
        makes the shard and replicate groups again and checks the model across the group: the collectives
        a replacement's ``FSDP(..., sync_module_states=False)`` runs at the same time. Then bring the
        replacement up to date with ``pp.checkpoint.sync({"model": fsdp, "optim": opt, ...},
        fsdp.replicate_group, has_state=True)``: its replicas hold the same shards (hybrid strategies and
        no_shard); with full_shard or shard_grad_op its shards are gone, so load a checkpoint instead.
        """
        for unit in self.units:
            self._drop_flat(unit)
            unit.gather_work = unit.grad_work = unit.replicate_work = None
            unit.grad_shard = None
            for key in ("replicated", "wire"):
                unit.extra.pop(key, None)
            self._release(unit)
            unit.drop_param_grads()
            unit.shard.grad = None
        self._reduce_queue = []
        self._round_open = self._forward_open = False
        self._used, self._backward_done = [], set()
        self._make_groups(self.shard_group.size)
        check_same_model(self.group, self._named)
        self.memory.update()

    def _shard_size(self, strategy: str, intra_size: int | None, hybrid: bool) -> int:
        n = self.group.size
        if not hybrid:
            if intra_size is not None:
                raise ValueError(f"intra_size applies to the hybrid strategies only, not {strategy!r}")
            return 1 if strategy == "no_shard" else n
        hosts = self.group.hosts()
        size = intra_size if intra_size is not None else len(hosts[0])
        if isinstance(size, bool) or not isinstance(size, int) or size < 1 or n % size:
            raise ValueError(f"intra_size={size!r} must be a positive divisor of the group size {n}")
        for start in range(0, n, size):
            if not any(set(range(start, start + size)) <= set(h) for h in hosts):
                raise ValueError(
                    f"intra_size={size} does not match the hosts: group ranks {start}..{start + size - 1} "
                    f"do not share one host (ranks per host: {[len(h) for h in hosts]}); hybrid strategies "
                    "shard inside a host and replicate across hosts"
                )
        return size

    def _chosen(
        self, module: Module, units: Sequence[Module] | UnitsByClass | None
    ) -> list[tuple[str, Module]]:
        """The unit modules with their paths: the default, a ``units_by_class`` policy's or the given list."""
        if units is None:
            return self._children(module)
        if isinstance(units, UnitsByClass):
            units = units.select(module)
        paths = {id(m): path for path, m in module.named_modules()}
        chosen = []
        for m in units:
            if id(m) not in paths or m is module:
                raise ValueError(
                    "every unit must be a submodule of the wrapped module (not the module itself)"
                )
            chosen.append((paths[id(m)], m))
        return chosen

    def _unit_groups(
        self,
        module: Module,
        named: list[tuple[str, Parameter]],
        units: Sequence[Module] | UnitsByClass | None,
    ) -> list[tuple[str, Module | None, list[tuple[str, Parameter]]]]:
        """(path, module, its parameters) per unit; the root unit (module None) holds the rest."""
        chosen = self._chosen(module, units)
        owner: dict[int, str] = {}
        groups: list[tuple[str, Module | None, list[tuple[str, Parameter]]]] = []
        by_id = {id(p): n for n, p in named}
        for path, m in chosen:
            mine = [(by_id[id(p)], p) for p in self._members(m) if id(p) in by_id]
            for _, p in mine:
                if id(p) in owner:
                    raise ValueError(
                        f"units overlap: parameter {by_id[id(p)]!r} is in unit {owner[id(p)]!r} and in {path!r}"
                    )
                owner[id(p)] = path
            if mine:
                groups.append((path, m, mine))
        rest = [(n, p) for n, p in named if id(p) not in owner]
        if rest:
            groups.append(("<root>", None, rest))
        return groups

    def _build_units(
        self,
        module: Module,
        named: list[tuple[str, Parameter]],
        units: Sequence[Module] | UnitsByClass | None,
        sync: bool,
    ) -> list[FlatUnit]:
        groups = self._unit_groups(module, named, units)
        built = []
        s_rank, s_count = self.shard_group.rank, self.shard_group.size
        for path, unit_module, mine in groups:
            dtypes = {p.dtype for _, p in mine}
            if len(dtypes) != 1:
                raise ValueError(
                    f"unit {path!r} mixes parameter dtypes {sorted(map(str, dtypes))}; FSDP needs one"
                )
            flat = concat_params([p for _, p in mine], sum(p.size for _, p in mine), self.master_dtype)
            if sync and self.group.size > 1:
                self.group.broadcast(flat, src=0)
            unit = FlatUnit.build(path, unit_module, mine, s_rank, s_count, flat)
            unit.release_from(flat)
            if self._host_shards:
                unit.shard.data = to_pinned(unit.shard.data)
            built.append(unit)
        return built

    def _wrap(self, unit: FlatUnit) -> None:
        m = unit.module
        assert m is not None
        orig_forward, orig_backward = m.forward, m.backward

        def forward(x: Array) -> Array:
            self._enter_unit(unit)
            start = time.monotonic()
            y = orig_forward(x)
            self._mark(f"forward {unit.name}", start)
            unit.forward_done = True
            if self.reshard_after_forward:
                self._release(unit)
            return y

        def backward(grad: Array) -> Array:
            self._ensure_gathered(unit)
            if self.backward_prefetch == "pre":
                self._prefetch(self._prev_in_forward(unit))
            start = time.monotonic()
            grad_in = orig_backward(grad)
            self._mark(f"backward {unit.name}", start)
            self._post_backward(unit)
            if self.backward_prefetch == "post":
                self._prefetch(self._prev_in_forward(unit))
            return grad_in

        self._originals.append((m, orig_forward, orig_backward))
        object.__setattr__(m, "forward", forward)
        object.__setattr__(m, "backward", backward)

    def _mark(self, name: str, start: float) -> None:
        tracer = self.group.tracer
        if tracer is not None and hasattr(tracer, "mark"):
            tracer.mark(f"fsdp {name}", start, time.monotonic())

    # -- forward / backward ------------------------------------------------------------------------
    def forward(self, x: Array) -> Array:
        """Run the module unit by unit: each unit is gathered for its forward (and prefetched).

        With mixed precision a floating-point ``x`` is cast to ``param_dtype`` (the compute dtype); the output
        is cast to ``output_dtype`` when one is set.
        """
        self._begin_forward()
        y = self.module.forward(self._cast_input(x))
        self._forward_open = True
        return y.astype(self.output_dtype) if self.output_dtype is not None else y

    def __call__(self, x: Array) -> Array:
        return self.forward(x)

    def backward(self, grad_out: Array) -> Array:
        """Run the module's backward; each unit's gradient reduce-scatter starts as soon as it is ready."""
        if not self._forward_open:
            raise ValueError("FSDP.backward() called without a forward() since the last backward")
        self._forward_open = False
        grad_out = grad_out.astype(self.param_dtype) if grad_out.dtype != self.param_dtype else grad_out
        grad_in = self.module.backward(grad_out)
        if self._root is not None:
            self._post_backward(self._root)
        return grad_in

    def _post_backward(self, unit: FlatUnit) -> None:
        self._backward_done.add(id(unit))
        self._release(unit)
        if self._no_sync:
            return
        self._round_open = True
        flat = unit.flatten_grads(self.reduce_dtype, self._xp)
        if self._predivide:
            flat *= flat.dtype.type(1.0 / self.group.size)
        self._launch_reduce(unit, flat)

    def _launch_reduce(self, unit: FlatUnit, flat: Array) -> None:
        if unit in self._reduce_queue:
            raise RuntimeError(
                f"FSDP: unit {unit.name!r} produced gradients twice in one step; call finish_gradient_sync() "
                "(or optimizer.step() on an attached optimizer) between synchronised backwards"
            )
        release = unit.extra["flat_release"] = self.memory.hold(
            "grads", flat.nbytes
        )  # with the layers' grads
        unit.drop_param_grads()
        if self.shard_group.size > 1:
            out = array_module(flat).empty(unit.shard_size, flat.dtype)
            unit.grad_shard = out
            # No reference to ``flat`` is kept: the group holds it while the reduce-scatter runs, so this
            # unit's largest transient is freed the moment the reduce-scatter is done (not when this thread
            # next looks), and reduce-scatters still in flight do not pile up flat gradients.
            unit.grad_work = self.shard_group.reduce_scatter(flat, "sum", out=out, async_op=True)
            unit.grad_work.future.add_done_callback(lambda _: release())
        else:
            unit.grad_shard = flat
        self._reduce_queue.append(unit)
        self._pump_replicate(block=False)

    def _drop_flat(self, unit: FlatUnit) -> None:
        """The unit's flat gradient is gone (reduce-scattered, or the step's work dropped)."""
        unit.extra.pop("flat_release", lambda: None)()

    def _pump_replicate(self, *, block: bool) -> None:
        """Start the replicate all-reduce of finished reduce-scatters, in unit launch order."""
        for unit in self._reduce_queue:
            if unit.extra.get("replicated"):
                continue
            if unit.grad_work is not None:
                if not block and not unit.grad_work.is_completed():
                    return
                unit.grad_work.wait()
                unit.grad_work = None
                self._drop_flat(unit)
            assert unit.grad_shard is not None
            if self.replicate_group.size > 1:
                wire = unit.grad_shard
                if self.comm_dtype is not None and is_floating(wire.dtype) and wire.dtype != self.comm_dtype:
                    wire = unit.extra["wire"] = wire.astype(self.comm_dtype)  # compressed across hosts
                unit.replicate_work = self.replicate_group.all_reduce(wire, "sum", async_op=True)
            unit.extra["replicated"] = True

    def finish_gradient_sync(self) -> None:
        """Wait for every gradient reduction and set each shard's ``grad`` (averaged over the group).

        A no-op when no synchronised backward ran since the last call, but for waiting for and dropping
        pending prefetched gathers (they read the shards, which an optimizer step changes next).
        """
        self._discard_prefetches()
        if not self._round_open:
            return
        try:
            for unit in self.units:  # units whose backward never ran (unused): zeros, same on every rank
                if unit not in self._reduce_queue and unit.has_param_grads():
                    self._post_backward(unit)  # torch: some of its parameters got no gradient this backward
                elif unit not in self._reduce_queue:
                    self._launch_reduce(unit, self._xp.zeros(unit.padded, self.reduce_dtype))
            self._pump_replicate(block=True)
            scale = 1.0 if self._predivide else 1.0 / self.group.size
            for unit in self._reduce_queue:
                if unit.replicate_work is not None:
                    unit.replicate_work.wait()
                assert unit.grad_shard is not None
                if "wire" in unit.extra:
                    unit.grad_shard[...] = unit.extra.pop("wire")
                g = unit.grad_shard.astype(self.master_dtype) * scale
                shard = unit.shard
                if self._host_shards and shard.grad is None:  # into this unit's reused page-locked buffer
                    shard.grad = unit.extra["pinned_grad"] = to_pinned(g, unit.extra.get("pinned_grad"))
                elif self._host_shards:
                    shard.grad += to_host(g)
                elif shard.grad is None:
                    shard.grad = g
                else:
                    shard.grad += g
        finally:
            for unit in self._reduce_queue:
                self._drop_flat(unit)
                unit.grad_shard = None
                unit.grad_work = unit.replicate_work = None
                unit.extra.pop("replicated", None)
                unit.extra.pop("wire", None)
            self._reduce_queue = []
            self._round_open = False

    def attach(self, optimizer: Optimizer) -> RemovableHandle:
        """Make ``optimizer.step()`` call :meth:`finish_gradient_sync` first; returns the hook handle."""
        if not isinstance(optimizer, Optimizer):
            raise ValueError(f"attach() takes a paramplane.optim optimizer, got {type(optimizer).__name__}")
        self._optimizer = optimizer
        optimizer.register_step_post_hook(lambda _opt: self.memory.update())
        return optimizer.register_step_pre_hook(lambda _opt: self.finish_gradient_sync())

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate full gradients locally, without communication (like torch)."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    # -- gradients ---------------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Scale the shards' gradients so the global norm is at most ``max_norm``; returns the norm.

        The norm is of the full gradient (each element counted once), the same on every rank.
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
        return norm

    # -- inspection --------------------------------------------------------------------------------
    def parameters(self) -> list[Parameter]:
        """This rank's flat shards (what an optimizer should step)."""
        return [u.shard for u in self.units]

    def named_parameters(self) -> list[tuple[str, Parameter]]:
        return [(u.shard.name, u.shard) for u in self.units]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for unit in self.units:
            if set_to_none:
                unit.shard.grad = None
            elif unit.shard.grad is not None:
                unit.shard.grad[...] = 0
            unit.drop_param_grads()
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
            "optim_state": self._optim_bytes(),
        }

    def _optim_bytes(self) -> int:
        if self._optimizer is None:
            return 0
        mine = {id(u.shard) for u in self.units}
        opt = self._optimizer
        return sum(
            int(v.nbytes)
            for i, state in opt.state.items()
            if id(opt.params[i]) in mine
            for v in state.values()
            if hasattr(v, "nbytes")
        )

    def __repr__(self) -> str:
        return (
            f"FSDP({type(self.module).__name__}, strategy={self.strategy}, units={len(self.units)}, "
            f"shard={self.shard_group.size}, replicate={self.replicate_group.size})"
        )
