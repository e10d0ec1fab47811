"""torch.distributed over paramplane: a c10d backend, so that a script's own ``dist.*`` calls run unchanged.

A torch training script calls ``torch.distributed`` beside its model wrapper: ``dist.all_reduce(loss)`` for
logging, ``dist.barrier()`` around rank-0 work, ``dist.broadcast_object_list`` for a config, ``dist.new_group``
for a subgroup, and libraries it uses do the same. ``pp.init_torch_distributed(world)`` makes torch's default
process group a paramplane one over ``world``, so those calls run on the plane (and torch's own
``DistributedDataParallel`` too)::

    world = pp.init()
    pp.init_torch_distributed(world)     # instead of dist.init_process_group("gloo")
    dist.all_reduce(loss_sum)             # world.group's all_reduce, in place on the torch tensor
    sub = dist.new_group([0, 1])          # world.new_group: members create groups in one order, as torch's

Every collective checks its arguments before any communication (torch's ``ValueError``s and ours); shapes that
disagree across ranks are a ``CollectiveMismatch`` from the plane, a dead peer a ``PeerLost``, a collective that
does not complete a ``CollectiveTimeout`` after the world's timeout, as with paramplane's own calls.
``async_op=True`` gives a torch ``Work`` whose ``wait()`` and ``get_future()`` follow the op.

Supported: all_reduce (SUM, AVG, MIN, MAX, PRODUCT), reduce (as all_reduce: every rank gets the result),
broadcast, all_gather, all_gather_into_tensor, reduce_scatter, reduce_scatter_tensor, gather, scatter,
all_to_all_single and all_to_all (split sizes included: ``paramplane.all_to_all``), barrier,
send / recv / batch_isend_irecv (tag 0: messages between two ranks match in order), and what torch builds on them
(``*_object`` calls, torch's functional collectives that DTensor and tensor parallel issue from C++: the
``*_coalesced`` calls; not ``monitored_barrier``); ``dist.new_group`` makes groups of this backend only (another
backend's rendezvous needs store calls a Python store cannot serve). CPU tensors, and CUDA tensors (after
``world.use_gpu()``; cupy views of them, NCCL inside the host for all_reduce, broadcast, all_gather and reduce_scatter,
host staging for the rest, enqueued on torch's current stream before the call returns; not yet run on a GPU).
Other ops raise a ``RuntimeError`` naming the op. The store torch sees (``dist.distributed_c10d
._get_default_store()``, and each group's) is the coordinator's key/value store, under the prefix ``torch/``:
``set``, ``get`` (waits for the key, as torch's), ``add`` and ``compare_set`` (torch 2.13 lets a Python store
serve those four).

The ``*_object`` calls pickle the caller's objects, as torch's do: the plane carries their bytes and never
unpickles anything itself; only ``dist.broadcast_object_list`` and its kind in the caller's own code do.
"""

from __future__ import annotations

import contextlib
import importlib.util
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from paramplane.group import _then
from paramplane.torch_store import kv_store
from paramplane.torch_work import DONE, all_done, future_of, plane_work

if TYPE_CHECKING:
    from paramplane.group import ProcessGroup
    from paramplane.world import World

BACKEND = "paramplane"
"""The backend's name in ``torch.distributed`` (``dist.get_backend()``)."""
_OPS = {"SUM": "sum", "AVG": "mean", "MIN": "min", "MAX": "max", "PRODUCT": "product"}

_lock = threading.Lock()
# "world": the world torch's groups run over; "store": its store (torch's C++ side calls the Python methods of a
# live object only). Process-wide, as torch's default group is.
_current: dict[str, Any] = {}


def init_torch_distributed(world: World, *, timeout: timedelta | None = None) -> None:
    """Make torch's default process group a paramplane one over ``world`` (module docstring); every rank of
    ``world`` calls it once, where a torch script calls ``dist.init_process_group``. ``timeout`` is torch's
    (default: the world's collective timeout)."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise ValueError(
            "torch.distributed is initialised already (dist.init_process_group ran): call "
            "pp.init_torch_distributed(world) instead of it, not after it"
        )
    with _lock:
        if not hasattr(dist.Backend, BACKEND.upper()):
            dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
        _current["world"], _current["store"] = world, kv_store(world)
    if timeout is None:
        timeout = timedelta(seconds=world.group.timeout)
    dist.init_process_group(
        BACKEND, rank=world.rank, world_size=world.world_size, store=_current["store"], timeout=timeout
    )


def _create(options: Any, _backend_options: Any = None) -> Any:
    """torch's backend creator: the default group over the world, a ``dist.new_group`` over its ranks."""
    with _lock:
        world: World | None = _current.get("world")
    if world is None:
        raise RuntimeError(
            "the paramplane backend runs over a paramplane world: call pp.init_torch_distributed(world) "
            "instead of dist.init_process_group('paramplane')"
        )
    ranks = list(options.global_ranks_in_group)
    if not ranks or ranks == list(range(world.world_size)):
        group = world.group
    else:
        made = world.new_group(ranks, timeout=options.timeout.total_seconds())
        assert made is not None  # torch creates a group's backend on its members only
        group = made
    return plane_process_group(group, options.group_id)


def _check_tag(tag: int, op: str) -> None:
    if tag != 0:
        raise ValueError(
            f"{op} with tag={tag}: the paramplane backend matches messages between two ranks in order, "
            "tags are not supported (pass tag=0)"
        )


def _op(reduce_op: Any, what: str) -> str:
    name = str(getattr(reduce_op, "op", reduce_op)).rsplit(".", 1)[-1]
    if name not in _OPS:
        raise ValueError(f"{what}: the paramplane backend reduces with {sorted(_OPS)}, not {name}")
    return _OPS[name]


def _one(tensors: list[Any], what: str) -> Any:
    if len(tensors) != 1:
        raise ValueError(f"{what} takes one tensor per rank (one device), got {len(tensors)}")
    return tensors[0]


def _contiguous(t: Any, what: str) -> Any:
    """``t`` for the plane: its storage without autograd (c10d ops write tensors that require grad in place, as
    gloo's do: a parameter broadcast under no_grad, a loss reduced for logging); checked first."""
    if not t.is_contiguous():
        raise ValueError(f"{what} needs a contiguous tensor (call .contiguous() first)")
    if t.device.type == "cuda":
        if importlib.util.find_spec("cupy") is None:
            raise ValueError(
                f"{what}: a tensor on {t.device} needs cupy (pip install 'paramplane[gpu]') for the plane to move it"
            )
        if str(t.dtype) == "torch.bfloat16":
            raise ValueError(
                f"{what}: torch.bfloat16 on {t.device} is not moved by the plane (cupy holds no bfloat16)"
            )
    elif t.device.type != "cpu":
        raise ValueError(f"{what}: the paramplane backend takes CPU and CUDA tensors, got one on {t.device}")
    return t.detach()


def _anchor(result: Any) -> Any:
    """The first tensor in an op's tensors (a tensor, a list, a list of lists), or None."""
    while isinstance(result, (list, tuple)):
        if not result:
            return None
        result = result[0]
    return result if hasattr(result, "device") else None


def _on_device(result: Any) -> contextlib.AbstractContextManager[None]:
    """For CUDA tensors: torch's current stream as the one the plane enqueues on (NCCL inside the host)."""
    anchor = _anchor(result)
    if anchor is None or anchor.device.type != "cuda":
        return contextlib.nullcontext()
    from paramplane.parallel.torch_params import torch_stream

    return torch_stream(anchor)


_built: list[type] = []  # PlaneProcessGroup, made on first use (importing this module does not import torch)


def plane_process_group(group: ProcessGroup, name: str) -> Any:
    """A torch ``ProcessGroup`` named ``name`` over the paramplane ``group`` (module docstring);
    ``dist.init_process_group`` and ``dist.new_group`` make them once ``init_torch_distributed`` ran."""
    with _lock:
        if not _built:
            _built.append(_build())
    return _built[0](group, name)


def _build() -> type:
    import torch
    import torch.distributed as dist

    base: Any = dist.ProcessGroup  # torch's overloads are not this class's (one tensor list per call)

    class Built(base):
        def __init__(self, group: ProcessGroup, name: str) -> None:
            super().__init__(group.rank, group.size)
            self.plane_group = group
            self._name = name

        @property
        def group_name(self) -> str:
            """torch's name of the group (torch sets it on a backend it builds itself; DeviceMesh reads it)."""
            return self._name

        def getBackendName(self) -> str:  # torch's name
            return BACKEND

        def _as_work(self, work: Any, result: Any) -> Any:
            return plane_work(future_of(work), result)

        def _issue(self, opts: Any, call: Any, result: Any, then: Any = None) -> Any:
            """``call(async_op)`` (a paramplane op) as a torch ``Work`` holding ``result``; ``then(value)`` after
            it. torch says (``opts.asyncOp``) whether the caller goes on before waiting: if not, the op runs on
            the caller's thread (paramplane's fast path, no future) and the Work is done. An op on CUDA tensors
            is enqueued on torch's current stream before this returns (as NCCL's are), so its Work is done too."""
            anchor = _anchor(result)
            if anchor is not None and anchor.device.type == "cuda":
                with _on_device(anchor):
                    value = call(False)
                    if then is not None:
                        then(value)
                return plane_work(DONE, result)
            if getattr(opts, "asyncOp", True):
                future = future_of(call(True))
                return plane_work(_then(future, then) if then is not None else future, result)
            value = call(False)
            if then is not None:
                then(value)
            return plane_work(DONE, result)

        def allreduce(self, tensors: list[Any], opts: Any) -> Any:
            t = _contiguous(_one(tensors, "all_reduce"), "all_reduce")
            op = _op(opts.reduceOp, "all_reduce")
            return self._issue(opts, lambda a: self.plane_group.all_reduce(t, op, async_op=a), tensors)

        def allreduce_coalesced(self, tensors: list[Any], opts: Any) -> Any:
            op = _op(opts.reduceOp, "all_reduce_coalesced")
            with _on_device(tensors):
                works = [
                    self.plane_group.all_reduce(_contiguous(t, "all_reduce_coalesced"), op, async_op=True)
                    for t in tensors
                ]
            return plane_work(all_done(works), tensors)

        def broadcast(self, tensors: list[Any], opts: Any) -> Any:
            t = _contiguous(_one(tensors, "broadcast"), "broadcast")
            return self._issue(
                opts, lambda a: self.plane_group.broadcast(t, opts.rootRank, async_op=a), tensors
            )

        def allgather(self, output_tensors: list[list[Any]], input_tensors: list[Any], opts: Any) -> Any:
            t = _contiguous(_one(input_tensors, "all_gather"), "all_gather")
            outs = _one(output_tensors, "all_gather")
            n = self.plane_group.size
            if len(outs) != n or any(o.shape != t.shape or o.dtype != t.dtype for o in outs):
                raise ValueError(
                    f"all_gather needs {n} output tensors shaped like the input {tuple(t.shape)}"
                )
            gathered = torch.empty((n * t.numel(),), dtype=t.dtype, device=t.device)

            def split(_: Any) -> None:
                for i, o in enumerate(outs):
                    o.copy_(gathered[i * t.numel() : (i + 1) * t.numel()].view(t.shape))

            flat = t.reshape(-1)
            call = lambda a: self.plane_group.all_gather(flat, out=gathered, async_op=a)  # noqa: E731
            return self._issue(opts, call, output_tensors, split)

        def _gather_pair(self, output: Any, input: Any) -> tuple[Any, Any]:
            """``all_gather_into_tensor``'s tensors, checked, as the plane's (input, out)."""
            t = _contiguous(input, "all_gather_into_tensor")
            n = self.plane_group.size
            if output.numel() != n * t.numel() or output.dtype != t.dtype or not output.is_contiguous():
                raise ValueError(
                    f"all_gather_into_tensor needs a contiguous {t.dtype} output of {n} x {t.numel()} elements"
                )
            return t.reshape(-1), output.detach().view(-1)

        def _allgather_base(self, output: Any, input: Any, opts: Any) -> Any:  # torch's name
            flat, into = self._gather_pair(output, input)
            return self._issue(
                opts, lambda a: self.plane_group.all_gather(flat, out=into, async_op=a), output
            )

        def reduce_scatter(self, output_tensors: list[Any], input_tensors: list[list[Any]], opts: Any) -> Any:
            out = _contiguous(_one(output_tensors, "reduce_scatter"), "reduce_scatter")
            ins = _one(input_tensors, "reduce_scatter")
            n = self.plane_group.size
            if len(ins) != n or any(i.shape != out.shape or i.dtype != out.dtype for i in ins):
                raise ValueError(f"reduce_scatter needs {n} input tensors shaped like the output")
            flat = torch.cat([i.reshape(-1) for i in ins])
            op = _op(opts.reduceOp, "reduce_scatter")
            into = out.view(-1)
            call = lambda a: self.plane_group.reduce_scatter(flat, op, out=into, async_op=a)  # noqa: E731
            return self._issue(opts, call, output_tensors)

        def _scatter_pair(self, output: Any, input: Any) -> tuple[Any, Any]:
            """``reduce_scatter_tensor``'s tensors, checked, as the plane's (input, out)."""
            out = _contiguous(output, "reduce_scatter_tensor")
            t = _contiguous(input, "reduce_scatter_tensor")
            n = self.plane_group.size
            if t.numel() != n * out.numel() or t.dtype != out.dtype:
                raise ValueError(
                    f"reduce_scatter_tensor needs an input of {n} x {out.numel()} {out.dtype} elements"
                )
            return t.view(-1), out.view(-1)

        def _reduce_scatter_base(self, output: Any, input: Any, opts: Any) -> Any:
            op = _op(opts.reduceOp, "reduce_scatter_tensor")
            flat, into = self._scatter_pair(output, input)
            call = lambda a: self.plane_group.reduce_scatter(flat, op, out=into, async_op=a)  # noqa: E731
            return self._issue(opts, call, output)

        def gather(self, output_tensors: list[list[Any]], input_tensors: list[Any], opts: Any) -> Any:
            t = _contiguous(_one(input_tensors, "gather"), "gather")
            root = opts.rootRank
            if self.plane_group.rank == root:
                outs = _one(output_tensors, "gather")
                if len(outs) != self.plane_group.size or any(o.shape != t.shape for o in outs):
                    raise ValueError(
                        f"gather needs {self.plane_group.size} output tensors shaped like the input"
                    )

            def place(got: Any) -> None:
                if got is not None:
                    for i, o in enumerate(_one(output_tensors, "gather")):
                        o.copy_(got[i * t.numel() : (i + 1) * t.numel()].view(t.shape))

            flat = t.reshape(-1)
            return self._issue(
                opts, lambda a: self.plane_group.gather(flat, root, async_op=a), output_tensors, place
            )

        def scatter(self, output_tensors: list[Any], input_tensors: list[list[Any]], opts: Any) -> Any:
            out = _contiguous(_one(output_tensors, "scatter"), "scatter")
            root = opts.rootRank
            if self.plane_group.rank == root:
                chunks = [_contiguous(c, "scatter") for c in _one(input_tensors, "scatter")]
                if len(chunks) != self.plane_group.size or any(c.shape != out.shape for c in chunks):
                    raise ValueError(
                        f"scatter needs {self.plane_group.size} input tensors shaped like the output"
                    )
                call = lambda a: self.plane_group.scatter(chunks, root, async_op=a)  # noqa: E731
                return self._issue(opts, call, output_tensors, out.copy_)
            return self._issue(
                opts, lambda a: self.plane_group.scatter(out, root, async_op=a), output_tensors
            )

        def barrier(self, opts: Any = None) -> Any:
            return self._issue(opts, lambda a: self.plane_group.barrier(async_op=a), None)

        def send(self, tensors: list[Any], dst: int, tag: int) -> Any:
            _check_tag(tag, "send")
            t = _contiguous(_one(tensors, "send"), "send")
            with _on_device(t):
                return self._as_work(self.plane_group.send(t, dst, async_op=True), tensors)

        def recv(self, tensors: list[Any], src: int, tag: int) -> Any:
            _check_tag(tag, "recv")
            t = _contiguous(_one(tensors, "recv"), "recv")
            with _on_device(t):
                return self._as_work(self.plane_group.recv(t, src, async_op=True), tensors)

        def allgather_into_tensor_coalesced(self, outputs: list[Any], inputs: list[Any], opts: Any) -> Any:
            """Several ``all_gather_into_tensor`` at once: torch's functional collectives (DTensor's
            redistribute, tensor parallel) call this one from C++."""
            pairs = [self._gather_pair(o, i) for o, i in zip(outputs, inputs, strict=True)]
            with _on_device(outputs):
                works = [self.plane_group.all_gather(flat, out=into, async_op=True) for flat, into in pairs]
            return plane_work(all_done(works), outputs)

        def reduce_scatter_tensor_coalesced(self, outputs: list[Any], inputs: list[Any], opts: Any) -> Any:
            """Several ``reduce_scatter_tensor`` at once (torch's functional collectives, from C++)."""
            op = _op(opts.reduceOp, "reduce_scatter_tensor")
            pairs = [self._scatter_pair(o, i) for o, i in zip(outputs, inputs, strict=True)]
            with _on_device(outputs):
                works = [
                    self.plane_group.reduce_scatter(flat, op, out=into, async_op=True) for flat, into in pairs
                ]
            return plane_work(all_done(works), outputs)

        all_gather_single = _allgather_base  # torch 2.13's name for all_gather_into_tensor's call
        reduce_scatter_single = _reduce_scatter_base  # and reduce_scatter_tensor's

        def reduce(self, tensors: list[Any], opts: Any) -> Any:
            """torch's ``dist.reduce``: as all_reduce (every rank gets the result, which torch allows)."""
            t = _contiguous(_one(tensors, "reduce"), "reduce")
            op = _op(opts.reduceOp, "reduce")
            return self._issue(opts, lambda a: self.plane_group.all_reduce(t, op, async_op=a), tensors)

        def alltoall_base(
            self,
            output: Any,
            input: Any,
            output_split_sizes: list[int],
            input_split_sizes: list[int],
            opts: Any,
        ) -> Any:
            """``dist.all_to_all_single``: equal blocks of axis 0, or the split sizes given (an empty list:
            equal blocks on that side)."""
            out = _contiguous(output, "all_to_all_single")
            t = _contiguous(input, "all_to_all_single")
            if out.dtype != t.dtype or out.shape[1:] != t.shape[1:]:
                raise ValueError(
                    f"all_to_all_single needs an output of rows like the input's, {tuple(t.shape[1:])} {t.dtype}, "
                    f"got {tuple(out.shape)} {out.dtype}"
                )
            # an empty list is equal blocks on that side: the plane's None (the output's: as many rows as are sent,
            # which must fill the output, checked on every rank)
            splits = {
                "in_splits": list(input_split_sizes) or None,
                "out_splits": list(output_split_sizes) or None,
            }
            return self._issue(
                opts, lambda a: self.plane_group.all_to_all(t, out=out, async_op=a, **splits), output
            )

        def all_to_all_single(self, *args: Any) -> Any:  # torch 2.13's name for all_to_all_single's call
            return self.alltoall_base(*args)

        def alltoall(self, output_tensors: list[Any], input_tensors: list[Any], opts: Any) -> Any:
            """``dist.all_to_all``: input ``i`` to rank ``i``, output ``j`` from rank ``j``, any shapes of one dtype."""
            n = self.plane_group.size
            ins = [_contiguous(t, "all_to_all") for t in input_tensors]
            outs = [_contiguous(t, "all_to_all") for t in output_tensors]
            if len(ins) != n or len(outs) != n:
                raise ValueError(
                    f"all_to_all takes {n} input and {n} output tensors, got {len(ins)} and {len(outs)}"
                )
            if any(t.dtype != ins[0].dtype for t in ins + outs):
                raise ValueError("all_to_all: every input and output tensor must have one dtype")
            flat = torch.cat([t.reshape(-1) for t in ins])
            got = torch.empty(sum(o.numel() for o in outs), dtype=flat.dtype, device=flat.device)
            shapes = [i.shape for i in ins]
            same = all(s == shapes[0] for s in shapes) and all(o.shape == shapes[0] for o in outs)
            splits = (
                {}
                if same
                else {"in_splits": [i.numel() for i in ins], "out_splits": [o.numel() for o in outs]}
            )

            def split(_: Any) -> None:
                start = 0
                for o in outs:
                    o.copy_(got[start : start + o.numel()].view(o.shape))
                    start += o.numel()

            call = lambda a: self.plane_group.all_to_all(flat, out=got, async_op=a, **splits)  # noqa: E731
            return self._issue(opts, call, output_tensors, split)

        def recv_anysource(self, *args: Any) -> Any:
            raise RuntimeError("torch.distributed recv without src: not supported by the paramplane backend")

        def size(self) -> int:
            return self.plane_group.size

        def rank(self) -> int:
            return self.plane_group.rank

    Built.__name__ = Built.__qualname__ = "PlaneProcessGroup"
    return Built
