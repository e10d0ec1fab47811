"""``DDP``: data parallelism with bucketed gradient all-reduces that overlap the backward.

Usage::

    model = pp.DDP(model, world.group)     # broadcasts parameters (and buffers) from group rank 0
    model.attach(optimizer)                # optimizer.step() first waits for the gradient sync
    loss = crit(model.forward(x_shard), y_shard)
    model.backward(crit.backward())        # buckets start their all-reduce while backward runs
    optimizer.step()

How it works: parameters are packed, in reverse order (the order backward produces
their gradients), into flat buckets of about ``bucket_mb`` MiB, one dtype and array
library (numpy / cupy) per bucket, by torch DDP's rule: a bucket closes once it holds
``bucket_mb`` or more, and at the default size (25 MiB) the first closes at 1 MiB, so the
last layers' gradients start their all-reduce early. Each parameter's grad hook counts its calls; when
every parameter of a bucket has its gradient, the bucket copies the gradients into its
buffer and starts ``all_reduce(op, async_op=True)``. Buckets always start in the same
order (bucket i never before bucket i-1), so every rank issues the same collectives in
the same order. ``finish_gradient_sync()`` (run by the optimizer's step pre-hook after
``attach``) starts the buckets that are not complete, waits for all of them and writes
the averaged gradients into ``p.grad``. A host (numpy) bucket makes each ``p.grad`` a view of its slot when it
starts (the backward's own copy is dropped then), hands its buffer over to those gradients at the end of the
round and takes a new one when its next round packs: gradients are held once, not once in ``.grad`` and once
in the bucket, and no later round writes into a gradient handed out. A CUDA bucket keeps its buffer and
copies into ``p.grad``, as torch's reducer does.

The first synchronised backward only counts hook calls (all its buckets are reduced at
finish, without overlap); later ones start a bucket once each parameter has had as many
calls as it had before, so a tied parameter used twice is handled. A gradient that
arrives after its bucket started is a RuntimeError (call ``finish_gradient_sync()``
between synchronised backwards, accumulate with ``no_sync()``).

Parameters that get no gradient in a step are zeros in their bucket. If no rank produced
a gradient for one, its ``grad`` stays None on every rank (as in one process); if some
rank did, every rank receives the reduced value.

Compression: ``DDP(..., comm_dtype="bfloat16")`` (or ``"float16"``) casts each floating bucket to that dtype
for its all-reduce and back afterwards, like torch's ``bf16_compress_hook`` / ``fp16_compress_hook``: half
the bytes on the wire (between hosts), at the dtype's precision (bfloat16 keeps float32's range, float16 its
precision better but overflows above 65504). On cupy use float16 (cupy has no bfloat16).

torch modules: ``DDP(torch_module, group)`` (CPU or CUDA tensors) behaves as torch's ``DistributedDataParallel``
(``ddp_torch.py``): ``ddp(*args, **kwargs)`` returns ``module(*args, **kwargs)`` unchanged, each parameter is
seen through a DLPack view (``parallel/torch_params.py``), buckets fill from torch's post-accumulate-grad hooks
during ``loss.backward()``, and the sync finishes in an autograd callback, so every ``.grad`` is averaged
when ``loss.backward()`` returns (clipping between backward and step sees the averaged gradients).
``attach`` is then optional (a ``torch.optim`` optimizer; a no-op wait). The wrapper is a ``torch.nn.Module``
itself, a view of its module under the module's names (``module_view.py``). Usage is discovered every step,
so parameters unused in some steps need no flag: ``find_unused_parameters`` is accepted for torch's call
shape and changes nothing.

Splitting a global batch: :func:`shard_range` gives rank r the ``numpy.array_split``
slice (the first ``B % N`` ranks one sample more). With equal shards, a ``"mean"`` loss
and the default ``reduce_op="mean"`` give exactly the gradient of one process on the
whole batch. With uneven shards use ``DDP(..., reduce_op="sum")``, a ``"sum"`` loss and
``crit.backward(grad_scale=1 / global_batch)``: the sum over ranks of the per-shard sums,
divided by the global batch, is again the global mean.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

import numpy as np

from paramplane.group import ProcessGroup
from paramplane.nn.module import Array, LoadResult, Module, Parameter
from paramplane.node.arrays import DTYPES, is_floating
from paramplane.parallel.ddp_buckets import (
    COMM_DTYPES,
    DEFAULT_BUCKET_MB,
    FIRST_BUCKET_BYTES,
    MIB,
    Bucket,
    assign_buckets,
    broadcast_arrays,
    release_freed_memory,
    shard_range,
)
from paramplane.parallel.ddp_experts import clip_grad_norm, expert_pieces, scale_expert_grads
from paramplane.parallel.ddp_join import JoinState, joined_rounds
from paramplane.parallel.ddp_torch import ModulePath, NNPath, TorchPath, comm_hook_dtype, torch_ddp_keywords
from paramplane.parallel.fsdp.units import check_same_model
from paramplane.parallel.module_view import module_view_class
from paramplane.parallel.torch_params import (
    TorchModule,
    check_device_ids,
    claim_parameters,
    is_torch_module,
    is_wrapper,
    module_attribute,
    refuse_copy,
    refuse_wrapper,
    release_parameters,
    wrapper_group,
)

__all__ = ["DDP", "broadcast_arrays", "shard_range"]

_REDUCE_OPS = ("mean", "sum")


class DDP:
    """Wrap ``module`` for data parallelism over ``group`` (see the module docstring). Over a torch module the
    wrapper is a ``torch.nn.Module`` itself, a view of its module (``module_view.py``)."""

    WRAPS_A_MODULE: ClassVar[bool] = True

    def __reduce_ex__(self, protocol: Any) -> Any:
        refuse_copy(self)

    def __new__(cls, module: Any, *args: Any, **kwargs: Any) -> DDP:
        if cls is DDP and is_torch_module(module) and not is_wrapper(module):
            return cast(DDP, super().__new__(module_view_class(DDP)))
        return super().__new__(cls)

    def __init__(
        self,
        module: Module | TorchModule,
        group: ProcessGroup | None = None,
        bucket_mb: float | None = None,
        broadcast_buffers: bool | None = None,
        *,
        process_group: ProcessGroup | None = None,
        reduce_op: str = "mean",
        comm_dtype: str | None = None,
        init_sync: bool = True,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        device_ids: Sequence[Any] | None = None,
        output_device: Any = None,
        bucket_cap_mb: float | None = None,
        static_graph: bool = False,
        forward_sync_buffers: bool | None = None,
        bucket_cap_mb_list: Sequence[float] | None = None,
        device_mesh: Any = None,
        dim: int = 0,
        check_reduction: bool = False,
        skip_all_reduce_unused_params: bool = False,
        batched_grad_copy: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
    ) -> None:
        """``bucket_mb`` is torch's ``bucket_cap_mb``: None gives 25 MiB buckets after a 1 MiB first one, a
        number gives buckets of that size from the first (module docstring).
        ``init_sync=False`` skips the wrap-time broadcast of parameters and buffers from group rank 0
        (a collective every rank must join): a replacement rank wrapping its model after
        ``World.reform()`` gets its state from ``pp.checkpoint.sync`` instead, as the survivors do not
        wrap again. ``find_unused_parameters`` is torch's keyword, accepted so torch calls run unchanged:
        every step finds the parameters that got a gradient whatever its value (module docstring).
        ``gradient_as_bucket_view=True`` (torch's keyword, False by default as there): after a synchronised
        backward each ``p.grad`` is a view of its bucket, so the gradients are held once instead of twice (the
        backward's own gradient is copied in and dropped when its bucket starts, and no copy back is made);
        backwards accumulate into the views in place, and the buckets keep their buffers. With False, host
        buckets also hold the gradients once, but hand their buffers over after each sync (module
        docstring): what ``.grad`` holds is never written by a later round, as with torch's default.
        torch's other keywords, so its calls run unchanged: ``device_ids`` / ``output_device`` must name the
        module's own device (one device per rank, as torch requires; the module is not moved),
        ``bucket_cap_mb`` is ``bucket_mb``, ``bucket_cap_mb_list`` gives each bucket its own size (the last
        for every bucket after), ``process_group`` is ``group`` and ``device_mesh`` a 1-D torch DeviceMesh
        over paramplane's torch.distributed backend (pass one of the three). Buffers follow torch 2.13:
        ``broadcast_buffers=False`` broadcasts them neither at wrap time nor before forwards,
        ``forward_sync_buffers=False`` only at wrap time. ``static_graph``, ``dim``, ``check_reduction``,
        ``skip_all_reduce_unused_params`` and ``batched_grad_copy`` change nothing here
        (``ddp_torch.torch_ddp_keywords`` says why); ``delay_all_reduce_named_params``,
        ``param_to_hook_all_reduce`` and ``mixed_precision`` are refused."""
        refuse_wrapper(module, "DDP")
        group = wrapper_group("DDP", group, process_group, device_mesh)
        torch_module = is_torch_module(module)
        if bucket_cap_mb is not None:
            if bucket_mb is not None and bucket_mb != bucket_cap_mb:
                raise ValueError(f"bucket_mb={bucket_mb!r} and bucket_cap_mb={bucket_cap_mb!r} disagree")
            bucket_mb = bucket_cap_mb
        buffers_at_wrap, broadcast_buffers = torch_ddp_keywords(
            broadcast_buffers=broadcast_buffers,
            forward_sync_buffers=forward_sync_buffers,
            static_graph=static_graph,
            dim=dim,
            check_reduction=check_reduction,
            skip_all_reduce_unused_params=skip_all_reduce_unused_params,
            batched_grad_copy=batched_grad_copy,
            unsupported={
                "delay_all_reduce_named_params": delay_all_reduce_named_params,
                "param_to_hook_all_reduce": param_to_hook_all_reduce,
                "mixed_precision": mixed_precision,
            },
        )
        if (device_ids is not None or output_device is not None) and torch_module:
            check_device_ids(module, device_ids, output_device)
        if not isinstance(module, Module) and not torch_module:
            raise ValueError(
                f"DDP wraps a paramplane.nn.Module or a torch.nn.Module, got {type(module).__name__}"
            )
        if bucket_mb is not None and not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb!r}")
        caps = None  # bucket_cap_mb_list's limits in bytes (torch: bucket_cap_mb is then ignored)
        if bucket_cap_mb_list is not None:
            if not bucket_cap_mb_list or not all(
                isinstance(c, (int, float)) and c > 0 for c in bucket_cap_mb_list
            ):
                raise ValueError(
                    f"bucket_cap_mb_list must be positive sizes in MiB, got {bucket_cap_mb_list!r}"
                )
            caps = [max(1, int(c * MIB)) for c in bucket_cap_mb_list]
            # the wrap-time broadcast's buckets: the largest limit (torch's bucket_bytes_cap)
            bucket_mb = max(bucket_cap_mb_list)
        if reduce_op not in _REDUCE_OPS:
            raise ValueError(f"reduce_op must be 'mean' or 'sum', got {reduce_op!r}")
        if comm_dtype not in COMM_DTYPES:
            raise ValueError(f"comm_dtype must be one of {COMM_DTYPES}, got {comm_dtype!r}")
        if not isinstance(find_unused_parameters, bool):
            raise ValueError(f"find_unused_parameters must be a bool, got {find_unused_parameters!r}")
        if not isinstance(gradient_as_bucket_view, bool):
            raise ValueError(f"gradient_as_bucket_view must be a bool, got {gradient_as_bucket_view!r}")
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self._path: ModulePath = TorchPath(module) if torch_module else NNPath(module)
        self._superseded = False  # a newer pp.DDP of the same module took over its hooks
        if torch_module:  # the rewrap of a module (``DDP(ddp.module)``): the newer wrapper takes over
            for old in claim_parameters(module, self, "pp.DDP"):
                old.remove_hooks()
                old._superseded = True
        self.find_unused_parameters = find_unused_parameters
        self.comm_dtype = np.dtype(DTYPES[comm_dtype]) if comm_dtype is not None else None
        self._hooked = False  # register_comm_hook ran
        self.module = module
        self.group = group
        self.bucket_mb = DEFAULT_BUCKET_MB if bucket_mb is None else float(bucket_mb)
        self.broadcast_buffers = broadcast_buffers
        self.reduce_op = reduce_op
        self._tracer = _tracer_of(group)
        all_params = self._path.params()
        experts = expert_pieces(all_params, group) if torch_module else set()
        # expert-parallel pieces: each rank's own, neither broadcast nor bucketed (ddp_experts.py)
        self._experts = [p for i, p in enumerate(all_params) if i in experts]
        shared = [p for i, p in enumerate(all_params) if i not in experts]
        if init_sync:
            # Models that differ only in shapes of the same total size would otherwise train silently.
            names = [n for n, _ in module.named_parameters()]
            check_same_model(group, list(zip(names, all_params, strict=True)), "DDP")
            self._sync_state(shared, buffers=buffers_at_wrap)
            release_freed_memory()  # the broadcast's temporary buckets, else resident for the whole run
        self._params: list[Parameter] = [p for p in shared if p.requires_grad]
        if caps is not None:
            assignment = assign_buckets(self._params, caps)
        else:
            bucket_bytes = max(1, int(self.bucket_mb * MIB))
            first_bytes = FIRST_BUCKET_BYTES if bucket_mb is None else bucket_bytes
            assignment = assign_buckets(self._params, bucket_bytes, first_bytes)
        self._buckets = [Bucket.build(n, idx, self._params) for n, idx in enumerate(assignment)]
        where = {i: (b, k) for b in self._buckets for k, i in enumerate(b.params)}
        self._where: list[tuple[Bucket, int]] = [where[i] for i in range(len(self._params))]
        self._expected: list[int] | None = None
        self._round_open = False
        self._next_launch = 0
        self._no_sync = False
        self._mean_over = group.size  # what a mean divides by (join(): the ranks still training, if asked)
        self._join: JoinState | None = None
        self._handles: list[Any] = [
            p.register_grad_hook(functools.partial(self._on_grad, i)) for i, p in enumerate(self._params)
        ]
        self._handles += scale_expert_grads(self._experts, group, reduce_op)
        # A "sum" reduction of a gradient that already holds a reduced one would add that part once per rank:
        # what a synchronised round adds to is set aside (``_base``) and only the new part is reduced.
        self._synced: set[int] = set()  # parameters whose grad is what the last sync wrote
        self._base: dict[int, Array] = {}
        if reduce_op == "sum":
            self._handles += [
                p.register_grad_pre_hook(functools.partial(self._before_grad, i))
                for i, p in enumerate(self._params)
            ]

    # -- wrap-time sync ----------------------------------------------------------------------------
    def _sync_state(self, params: list[Parameter], src: int = 0, *, buffers: bool) -> None:
        """Broadcast parameters (coalesced per bucket) and, with ``buffers``, buffers from group rank ``src``."""
        if self.group.size == 1:
            return
        with self._path.stream():
            for n, indices in enumerate(assign_buckets(params, max(1, int(self.bucket_mb * MIB)))):
                bucket = Bucket.build(n, indices, params)
                for k, i in enumerate(indices):
                    bucket.slot(k)[...] = params[i].data.reshape(-1)
                self.group.broadcast(bucket.flat, src=src)
                for k, i in enumerate(indices):
                    params[i].data[...] = bucket.slot(k).reshape(params[i].shape)
        if buffers:
            self._broadcast_buffers(src)

    def _broadcast_buffers(self, src: int = 0) -> None:
        with self._path.stream():
            broadcast_arrays(self.group, self._path.buffers(), src=src)

    # -- grad hooks and buckets ----------------------------------------------------------------------
    def _on_grad(self, i: int, p: Parameter) -> None:
        if not self._path.syncs_backward(self._no_sync):
            return
        if self._tracer is not None:
            now = time.monotonic()
            self._tracer.mark(f"grad {self._names_of(i)}", now, now, param=self._names_of(i))
        self._round_open = True
        self._path.on_grad(self.finish_gradient_sync)
        bucket, k = self._where[i]
        if bucket.launched:
            raise RuntimeError(
                f"DDP: a gradient for parameter {self._names_of(i)!r} arrived after its bucket's all-reduce "
                "started. Call finish_gradient_sync() (or optimizer.step() on an attached optimizer) between "
                "synchronised backwards, accumulate locally inside `with ddp.no_sync():`, and use each "
                "parameter the same number of times in every step"
            )
        if self.gradient_as_bucket_view:
            self._keep_in_bucket(bucket, k, self._params[i])
        fired = bucket.fired[k] = bucket.fired[k] + 1
        if self._expected is not None and fired == self._expected[i]:  # expected 0: never ready before finish
            bucket.waiting -= 1
            if bucket.waiting == 0 and bucket.index == self._next_launch:
                with self._path.stream():
                    self._launch_ready()

    def _keep_in_bucket(self, bucket: Bucket, k: int, p: Parameter) -> None:
        """``gradient_as_bucket_view``: as soon as the backward made ``p.grad``, copy it into its slot and make
        ``p.grad`` that slot (as torch's reducer does), so the backward's own copy is freed at once and later
        accumulations (a tied parameter's second use, ``no_sync``) go into the bucket in place."""
        grad = p.grad
        if grad is not None and not bucket.holds(k, grad):
            with self._path.stream():
                bucket.slot(k)[...] = grad.reshape(-1)
            p.grad = bucket.slot(k).reshape(p.shape)

    def _before_grad(self, i: int, p: Parameter) -> None:
        if i in self._synced:
            self._synced.discard(i)
            if p.grad is not None:
                self._base[i] = p.grad.copy()

    def _names_of(self, i: int) -> str:
        return self._params[i].name or str(i)

    def _launch_ready(self) -> None:
        """Launch, in order, the buckets whose every parameter had its expected hook calls (``Bucket.waiting``
        counts the others, so a hook costs O(1) however large its bucket)."""
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].waiting == 0:
            self._launch(self._buckets[self._next_launch])

    def _launch(self, bucket: Bucket) -> None:
        # a mean divides in the copy into the bucket and sums (torch's reducer: one pass over the gradients less)
        scale = 1.0 / self._mean_over if self.reduce_op == "mean" else None
        for k, i in enumerate(bucket.params):
            if i in self._synced:  # no contribution since the last sync: what it holds is reduced already
                self._before_grad(i, self._params[i])
            p = self._params[i]
            grad, base = p.grad, self._base.get(i)
            bucket.pack(k, grad if base is None or grad is None else grad - base, scale)
            if self._as_view(bucket) and grad is not None and not bucket.holds(k, grad):
                p.grad = bucket.slot(k).reshape(p.shape)  # the backward's own copy is dropped here
        bucket.seal()
        bucket.launched = True
        wire = bucket.flat
        if (
            self.comm_dtype is not None
            and is_floating(bucket.flat.dtype)
            and bucket.flat.dtype != self.comm_dtype
        ):
            wire = bucket.flat.astype(self.comm_dtype)  # compressed on the wire, cast back in finish
        bucket.wire = wire
        with self._path.comm_stream():  # CUDA: beside the backward's stream, as torch's NCCL work
            bucket.work = self.group.all_reduce(wire, "sum", async_op=True)
        self._next_launch += 1

    def _as_view(self, bucket: Bucket) -> bool:
        """Whether this round's reduced gradients are views of ``bucket``: always with
        ``gradient_as_bucket_view``; else for a host (numpy) bucket, which then hands its buffer over to them
        at the end of the round and takes a new one for the next (so gradients are held once, not once in
        ``.grad`` and once in the bucket, and no copy back is made). CUDA buckets keep torch's layout."""
        return self.gradient_as_bucket_view or bucket.on_host

    def finish_gradient_sync(self) -> None:
        """Start the buckets still waiting, wait for every all-reduce and write ``p.grad``.

        A no-op when no synchronised backward ran since the last call. Raises the
        collective's error (a ``PlaneError``) if one failed.
        """
        if not self._round_open:
            return
        with self._path.stream():
            self._finish()

    def _finish(self) -> None:
        start = time.monotonic()
        try:
            for bucket in self._buckets[self._next_launch :]:
                self._launch(bucket)
            for bucket in self._buckets:
                assert bucket.work is not None
                bucket.work.wait()
            self._path.join_comm()
            for bucket in self._buckets:
                if bucket.wire is not None and bucket.wire is not bucket.flat:
                    bucket.flat[...] = bucket.wire
            for bucket in self._buckets:
                bucket.unpack(self._params, self._as_view(bucket))
                if not self.gradient_as_bucket_view and self._as_view(bucket):
                    bucket.hand_over()
            for i, base in self._base.items():
                grad = self._params[i].grad
                if grad is not None:
                    grad += base
            self._base.clear()
            if self.reduce_op == "sum":  # what the next round may add to (see __init__)
                self._synced = set(range(len(self._params)))
            observed = [0] * len(self._params)
            for bucket in self._buckets:
                for k, i in enumerate(bucket.params):
                    observed[i] = bucket.fired[k]
            if self._expected is None:
                self._expected = observed
            else:
                self._expected = [max(a, b) for a, b in zip(self._expected, observed)]
        finally:
            for bucket in self._buckets:
                bucket.reset()
            self._next_launch = 0
            self._round_open = False
            if self._tracer is not None:
                self._tracer.mark("ddp gradient sync wait", start, time.monotonic())

    def attach(self, optimizer: Any) -> Any:
        """Make ``optimizer.step()`` call :meth:`finish_gradient_sync` first; returns the hook handle.

        A ``paramplane.optim`` optimizer, or a ``torch.optim`` one for a torch module (where the sync has
        already finished when ``loss.backward()`` returned: the hook is then a no-op)."""
        return self._path.attach(optimizer, self.finish_gradient_sync)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate into ``p.grad`` locally, without communication (for a torch module,
        as with torch's DDP: backwards of forwards that ran inside).

        The next synchronised backward reduces the accumulated gradients (like torch).
        """
        previous = self._no_sync
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = previous

    @contextlib.contextmanager
    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Iterator[None]:
        """torch DDP's ``join()`` for uneven inputs (a torch module; ``ddp_join``): a rank whose loop ends
        inside shadows the others' steps until every rank's has ended, then all take the parameters of the
        rank that trained longest. The arguments are torch's."""
        if not isinstance(self._path, TorchPath):
            raise ValueError("DDP.join() is for torch modules (torch's DistributedDataParallel.join)")
        if self._experts and enable:
            raise ValueError(
                "DDP.join() with expert-parallel experts: a rank whose inputs ran out cannot take part in the "
                "other ranks' token exchanges; give every rank the same number of batches"
            )
        if self._join is not None:
            raise RuntimeError("DDP.join() is already active")
        if not enable or self.group.size == 1:
            yield
            return
        self._join = state = JoinState(divide_by_initial_world_size, throw_on_early_termination)
        try:
            yield
            joined_rounds(self, state)  # not after an error: the world is being torn down then
        finally:
            self._join = None
            self._mean_over = self.group.size

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """torch DDP's call shape for its compression hooks: ``default_hooks.fp16_compress_hook`` and
        ``bf16_compress_hook`` set ``comm_dtype`` to float16 / bfloat16 (``state`` is unused, None in torch's
        examples); other hooks are a NotImplementedError. Once, before the first backward, as torch's."""
        del state
        dtype = comm_hook_dtype(hook)
        if self._hooked or self._expected is not None:
            raise RuntimeError("register_comm_hook: once per DDP, before the first backward (as torch's)")
        self.comm_dtype = np.dtype(DTYPES[dtype])
        self._hooked = True

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag, which ``no_sync()`` clears inside: set False, backwards of the forwards that run
        meanwhile accumulate locally (nanoGPT's loop sets it before each micro-step's forward)."""
        return not self._no_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"require_backward_grad_sync must be a bool, got {value!r}")
        self._no_sync = not value

    # -- pass-through ------------------------------------------------------------------------------
    if not TYPE_CHECKING:  # (hidden from mypy, which would otherwise accept any attribute of a DDP)

        def __getattr__(self, name: str) -> Any:
            """A torch module's attributes the wrapper lacks (``torch_params.module_attribute``)."""
            return module_attribute(self, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward on every argument, its output unchanged. First re-broadcasts buffers from
        rank 0 when ``broadcast_buffers``: for a torch module when the previous forward ran with grad
        enabled outside ``no_sync`` (torch DDP's rule), for an ``nn`` one in training mode outside
        ``no_sync``."""
        if self._superseded:
            raise RuntimeError(
                "this pp.DDP was superseded by a newer pp.DDP of the same module, which took over its gradient "
                "hooks: use the newer one"
            )
        takes_buffers = (
            self.broadcast_buffers and self.group.size > 1 and self._path.syncs_buffers(self._no_sync)
        )
        if self._join is not None:  # one round with the ranks that may have run out of inputs
            import torch

            syncs = torch.is_grad_enabled() and not self._no_sync
            r = self._join.round(self, (1, int(syncs), int(takes_buffers)))
            self._join.num_steps += 1
            self._mean_over = self._join.mean_over(self, r)
            if r.buffers_from is not None:
                self._broadcast_buffers(src=r.buffers_from)
        elif takes_buffers:
            self._broadcast_buffers()
        return self._path.call(args, kwargs, self._no_sync)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def backward(self, grad_out: Array) -> Array:
        """``module.backward(grad_out)``; gradient buckets start their all-reduce as they fill."""
        if not isinstance(self._path, NNPath):
            raise RuntimeError(
                "a torch module runs its own backward: call loss.backward() (the buckets fill from it)"
            )
        start = time.monotonic()
        try:
            return self.module.backward(grad_out)
        finally:
            if self._tracer is not None:
                self._tracer.mark("backward", start, time.monotonic())

    def parameters(self, recurse: bool = True) -> Iterator[Any]:
        """The module's parameters (torch tensors for a torch module, to hand to a torch optimizer); an
        iterator, as torch's (``next(model.parameters())`` works; take a ``list`` to use them twice)."""
        return (p for _, p in self.named_parameters(recurse=recurse))

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Any]]:
        """The module's ``named_parameters`` (torch's arguments for a torch module)."""
        if isinstance(self._path, TorchPath):
            return iter(cast(Any, self.module).named_parameters(prefix, recurse, remove_duplicate))
        return ((prefix + ("." if prefix else "") + n, p) for n, p in self.module.named_parameters())

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Array]:
        """The module's ``state_dict`` (torch's arguments, ``keep_vars=True`` included, for a torch module):
        its keys, without torch DDP's ``module.`` prefix."""
        if args or kwargs:
            if not isinstance(self._path, TorchPath):
                raise ValueError("DDP.state_dict: arguments are a torch module's (prefix=, keep_vars=)")
            return cast(dict[str, Array], cast(Any, self.module).state_dict(*args, **kwargs))
        return self.module.state_dict()

    def load_state_dict(
        self, state_dict: dict[str, Array], strict: bool = True, assign: bool = False
    ) -> LoadResult:
        """The module's ``load_state_dict`` (torch's arguments); a state saved from torch's DDP (every key
        ``module.``-prefixed, as ``torch_ddp.state_dict()`` writes them) loads too, the prefix dropped.
        ``assign=True`` (the state's tensors replacing the parameters) is refused: the wrapper holds views of
        them."""
        if assign:
            raise ValueError(
                "DDP.load_state_dict: assign=True would replace the parameters the wrapper holds views of"
            )
        prefix = "module."
        if isinstance(self._path, TorchPath) and state_dict and all(k.startswith(prefix) for k in state_dict):
            own = cast(Any, self.module).state_dict(keep_vars=True)  # the keys (no copies)
            if not any(k.startswith(prefix) for k in own):
                state_dict = {k[len(prefix) :]: v for k, v in state_dict.items()}
        return self.module.load_state_dict(state_dict, strict)

    def optim_state(self, optimizer: Any, *, state_arrays: tuple[str, ...] | None = None) -> Any:
        """A torch module's ``optimizer`` (a ``torch.optim`` one over ``parameters()``) as checkpoint state keyed
        by parameter name (``pp.tp_optim_state`` of the module): ``pp.checkpoint.save({"model": ddp, "optim":
        ddp.optim_state(opt)}, ...)`` and ``load`` / ``sync``. Its keys are ``fsdp.optim_state(opt)``'s, so
        the checkpoint loads under pp.FSDP at any world size too. ``state_arrays`` names the optimizer's
        per-parameter state tensors where paramplane does not know them (to load into a fresh optimizer)."""
        from paramplane.parallel.tp_torch.optim import tp_optim_state

        if not isinstance(self._path, TorchPath):
            raise ValueError(
                "optim_state is for torch modules: a paramplane.optim optimizer is checkpointable itself"
            )
        return tp_optim_state(self.module, optimizer, state_arrays=state_arrays)

    def sharded_state_dict(self) -> dict[str, Any]:
        """What checkpoints save: the module's ``sharded_state_dict`` (a torch module's ``state_dict``)."""
        own = getattr(self.module, "sharded_state_dict", None)
        return dict(own()) if own is not None else dict(self.module.state_dict())

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        own = getattr(self.module, "load_sharded_state_dict", None)
        if own is not None:  # a torch module has none: its tensors were filled in place (DLPack views)
            own(state)

    def train(self, mode: bool = True) -> DDP:
        self.module.train(mode)
        return self

    def eval(self) -> DDP:
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none)

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def bucket_params(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order (for inspection and tests)."""
        return [[self._names_of(i) for i in b.params] for b in self._buckets]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Any:
        """torch modules: ``torch.nn.utils.clip_grad_norm_`` over the whole model after ``backward`` (call it on
        every rank): with expert-parallel experts (``ddp_experts.py``) their squares are summed over the
        group, so every rank clips by the same norm; returns it (a float64 tensor)."""
        if not isinstance(self._path, TorchPath):
            raise ValueError("DDP.clip_grad_norm_ is for torch modules")
        expert_ids = {id(cast(Any, p).tensor) for p in self._experts}
        tensors = [t for t in self.module.parameters() if t.requires_grad]
        replicated = [t for t in tensors if id(t) not in expert_ids]
        mine = [t for t in tensors if id(t) in expert_ids]
        return clip_grad_norm(replicated, mine, self.group, float(max_norm), float(norm_type))

    def remove_hooks(self) -> None:
        """Unregister the grad hooks (the module keeps working alone)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if isinstance(self._path, TorchPath):
            release_parameters(self.module, self)

    def __repr__(self) -> str:
        return f"DDP({type(self.module).__name__}, group={self.group.name}, buckets={len(self._buckets)})"


def _tracer_of(group: ProcessGroup) -> Any:
    """The rank's Chrome tracer when ``PARAMPLANE_TRACE`` is set, else None."""
    tracer = getattr(group, "tracer", None)
    return tracer if hasattr(tracer, "mark") else None
