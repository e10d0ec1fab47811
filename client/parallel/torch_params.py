"""torch modules under ``pp.DDP`` and ``pp.FSDP``: each parameter seen as a paramplane ``Parameter`` through
DLPack views (``TorchFlatParam``: FSDP re-points the tensor at pieces of its flat buffers).

The views are zero-copy arrays over the torch tensors: numpy for CPU tensors, cupy for CUDA ones (so the
plane's NCCL transport moves them inside a host with no host staging). DDP's broadcasts write into the
module's parameters and its reduced gradients land in ``p.grad`` in place. A gradient hook is torch's
``register_post_accumulate_grad_hook``: it fires once ``p.grad`` holds this backward's gradient.

CUDA ordering: a collective issued by a wrapper runs on cupy's current stream (the NCCL transport captures
it); ``torch_stream(tensor)`` makes that stream torch's current stream, so the collective is ordered after
the kernels that produced the tensor and before the ones that read it, without a device synchronisation.
torch is imported only when a torch module is wrapped.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from paramplane.group import ProcessGroup
from paramplane.node.arrays import DTYPES, is_moved, to_torch, torch_cpu_view

__all__ = [
    "MOVES",
    "CommStream",
    "EndOfBackward",
    "TorchFlatParam",
    "TorchModule",
    "TorchParam",
    "check_device_ids",
    "is_torch_module",
    "is_wrapper",
    "module_attribute",
    "output_tensors",
    "queue_backward_callback",
    "refuse_copy",
    "refuse_move",
    "refuse_wrapper",
    "to_array",
    "to_tensor",
    "to_torch",
    "torch_buffers",
    "torch_params",
    "torch_stream",
]


TorchModule = Any
"""A ``torch.nn.Module`` in the wrappers' signatures (torch is an optional dependency, so it is typed loosely)."""


def is_torch_module(module: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(module, torch.nn.Module)


MOVES = frozenset(
    ("to", "to_empty", "cuda", "cpu", "xpu", "type", "float", "double", "half", "bfloat16", "share_memory")
)
"""Module methods that move or cast parameters: a wrapper holds views of them, so it refuses these."""


def module_attribute(wrapper: Any, name: str) -> Any:
    """An attribute a wrapper of a torch module lacks is its module's, as with FSDP1's wrapper:
    ``model.config``, ``model.generate(...)``, ``model.named_modules()``, ``model.training``. A method that
    returns the module itself (``apply``, ``requires_grad_``) returns the wrapper instead, so that
    ``model = model.method(...)`` keeps the wrapper; moving or casting (``MOVES``) is refused: do it before
    wrapping. Private names (``_x``) are not passed on."""
    module = wrapper.__dict__.get("module")
    if module is None or name.startswith("_") or not is_torch_module(module):
        hint = ""
        if module is not None and name.startswith("_") and name in vars(module):
            hint = (  # torch code reading internals
                f" (it is its module's: .module.{name})"
                if is_torch_module(wrapper)
                else f" (pp.{type(wrapper).__name__.removeprefix('Torch')} is not a torch.nn.Module: pass its "
                ".module to torch functions that take a module)"
            )
        raise AttributeError(f"{type(wrapper).__name__!r} object has no attribute {name!r}{hint}")
    if name in MOVES:
        refuse_move(wrapper, name)
    value = getattr(module, name)
    if not callable(value) or getattr(value, "__self__", None) is not module:
        return value

    def call(*args: Any, **kwargs: Any) -> Any:
        out = value(*args, **kwargs)
        return wrapper if out is module else out

    call.__name__ = name
    call.__doc__ = value.__doc__
    return call


def is_wrapper(obj: Any) -> bool:
    """Whether ``obj`` is a pp.DDP or pp.FSDP (over any module)."""
    return bool(getattr(type(obj), "WRAPS_A_MODULE", False))


def refuse_wrapper(module: Any, wrapper: str) -> None:
    """A ValueError when ``module`` is a pp.DDP or pp.FSDP already: a module is wrapped once."""
    if is_wrapper(module):
        raise ValueError(
            f"{wrapper} was given a pp.{type(module).__name__.removeprefix('Torch')} wrapper: wrap the module "
            "itself, once"
        )


def refuse_copy(wrapper: Any) -> None:
    """The TypeError of ``copy.copy`` / ``copy.deepcopy`` / ``pickle`` of a wrapper (its ``__reduce_ex__``)."""
    name = type(wrapper).__name__.removeprefix("Torch")
    plain = (
        "copy.deepcopy(ddp.module)"
        if name == "DDP"
        else "copy.deepcopy(fsdp.module) inside fsdp.summon_full_params()"
    )
    raise TypeError(
        f"pp.{name} holds a live group and gradient hooks: it cannot be copied or pickled; for a plain copy of the "
        f"model take {plain}, to keep its state save its state_dict()"
    )


def refuse_move(wrapper: Any, name: str) -> None:
    """The RuntimeError of a move or cast (``MOVES``) of a wrapper."""
    raise RuntimeError(
        f"{type(wrapper).__name__.removeprefix('Torch')}.{name}(): move or cast the module before wrapping it (the wrapper holds views "
        "of its parameters and gradients)"
    )


def wrapper_group(
    wrapper: str, group: Any, process_group: Any, device_mesh: Any = None, *, hybrid: bool = False
) -> ProcessGroup:
    """The group a wrapper runs over: ``group`` or torch's keyword ``process_group`` (one of them, or both the same
    object), a ``ProcessGroup`` or a torch group of paramplane's torch.distributed backend, or the group of torch's
    ``device_mesh`` (``_mesh_group``; ``hybrid``: a 2-D one too); with none, torch's default group when
    ``pp.init_torch_distributed`` made it. Else a ValueError naming the mistake."""
    if group is not None and process_group is not None and group is not process_group:
        raise ValueError(f"{wrapper}: group and process_group name different groups; pass one of them")
    chosen = group if group is not None else process_group
    if device_mesh is not None:
        if chosen is not None:
            raise ValueError(f"{wrapper}: pass a group (or process_group) or a device_mesh, not both")
        chosen = _mesh_group(wrapper, device_mesh, hybrid)
    if chosen is None:
        chosen = _torch_default_group()
    if chosen is None:
        raise ValueError(
            f"{wrapper} needs a group: pass world.group (or a subgroup), positionally or as process_group= "
            "(or call pp.init_torch_distributed(world) first: torch's default group is then the default)"
        )
    if isinstance(chosen, tuple):
        raise ValueError(
            f"{wrapper}: process_group=(intra, inter) is FSDP1's HYBRID_SHARD form; pass world.group with "
            "strategy='hybrid_shard' and intra_size= (the shard group's size) instead"
        )
    plane = getattr(chosen, "plane_group", None)  # a torch group of paramplane's backend
    if isinstance(plane, ProcessGroup):
        return plane
    if not isinstance(chosen, ProcessGroup):
        if type(chosen).__module__.startswith("torch"):
            raise ValueError(
                f"{wrapper} runs over paramplane groups, got a torch.distributed group of another backend: pass "
                "world.group, or a group of the backend pp.init_torch_distributed(world) sets up"
            )
        if group is chosen and (isinstance(chosen, (int, str, list)) or type(chosen).__name__ == "device"):
            raise ValueError(
                f"{wrapper} needs a ProcessGroup, got {chosen!r} as its second argument (torch's DDP takes "
                "device_ids there: pass world.group second and device_ids=[...] by keyword)"
            )
        raise ValueError(f"{wrapper} needs a ProcessGroup, got {type(chosen).__name__}")
    return chosen


def _mesh_group(wrapper: str, device_mesh: Any, hybrid: bool) -> Any:
    """The group of torch's ``device_mesh=``: a 1-D mesh's group; with ``hybrid`` (FSDP1's HYBRID_SHARD) a 2-D
    mesh (replicate, shard) over the default group's ranks in order is that group (the shard groups are then
    its consecutive blocks of ``device_mesh.size(1)`` ranks: ``intra_size``)."""
    ndim = getattr(device_mesh, "ndim", None)
    if ndim == 1:
        return device_mesh.get_group(mesh_dim=0)
    if ndim == 2 and hybrid:
        default = _torch_default_group()
        ranks = device_mesh.mesh.flatten().tolist()
        if default is None or ranks != list(range(default.size)):
            raise ValueError(
                f"{wrapper}: a 2-D device_mesh must span the default group of pp.init_torch_distributed, its "
                f"ranks in order (init_device_mesh(device, (replicas, shard_size))), got ranks {ranks}"
            )
        return default
    allowed = "1-D, or 2-D (replicate, shard) with a hybrid strategy" if hybrid else "1-D, as torch's"
    raise ValueError(f"{wrapper}: device_mesh must be {allowed}, got {device_mesh!r}")


def _torch_default_group() -> ProcessGroup | None:
    """The paramplane group behind torch's default group, if ``pp.init_torch_distributed`` made it."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized():
        return None
    plane = getattr(dist.distributed_c10d._get_default_group(), "plane_group", None)
    return plane if isinstance(plane, ProcessGroup) else None


def check_device_ids(module: Any, device_ids: Any, output_device: Any) -> None:
    """torch DDP's ``device_ids`` / ``output_device``: each must name the device the module's parameters are
    on (a single device; None for a CPU module, as torch requires), else a ValueError."""
    import torch

    param = next(iter(module.parameters()), None)
    home = param.device if param is not None else torch.device("cpu")
    ids = [] if device_ids is None else list(device_ids)
    if len(ids) > 1:
        raise ValueError(f"device_ids must name one device per rank (torch's rule), got {ids}")
    for what, value in (("device_ids", ids[0] if ids else None), ("output_device", output_device)):
        if value is None:
            continue
        device = torch.device("cuda", value) if isinstance(value, int) else torch.device(value)
        same = device.type == home.type and (device.index is None or device.index == (home.index or 0))
        if not same:
            raise ValueError(
                f"{what}={value!r} is not the module's device ({home}): move the module there before "
                "wrapping it (torch.cuda.set_device(local_rank); model.cuda())"
            )


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn()`` when the backward that is running now ends (call it from inside an autograd hook).

    What torch's DDP reducer and FSDP2 do to make gradients final when ``loss.backward()`` returns: the
    engine runs queued callbacks after the last node of the graph task, before ``backward()`` returns.
    """
    from torch.autograd import Variable

    Variable._execution_engine.queue_callback(fn)


def output_tensors(value: Any) -> list[Any]:
    """The tensors in a module's output (a tensor, tuples, lists, dicts and ``ModelOutput``s of them)."""
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in output_tensors(v)]
    if isinstance(value, dict):  # transformers' ModelOutput is an OrderedDict
        return [t for v in value.values() for t in output_tensors(v)]
    return [value] if hasattr(value, "register_hook") else []


class EndOfBackward:
    """Runs ``fn`` once at the end of each backward in which ``request()`` is called (from autograd hooks), as
    torch's DDP reducer and FSDP2 finish their gradient sync.

    Once per outermost backward: a request from a backward that runs inside another one whose callback is still
    to run (a reentrant activation checkpoint recomputes its blocks and runs their backward as a graph task of its
    own, nested in the outer one) queues nothing, so the sync is not finished before the outer backward's other
    gradients arrived. The wrappers call ``reset()`` at each forward (no backward runs then): a backward that
    raised, whose callback never ran, cannot make the next one skip its own."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn
        self._pending = False

    def request(self) -> None:
        if self._pending:  # queued in this backward, or in the one this backward runs inside
            return
        self._pending = True
        queue_backward_callback(self._run)

    def _run(self) -> None:
        self._pending = False
        self._fn()

    def reset(self) -> None:
        """No backward is running (a forward starts): forget a callback that a raised backward never ran."""
        self._pending = False


def to_array(tensor: Any, what: str) -> Any:
    """A zero-copy view of a torch tensor: numpy for a CPU tensor (bfloat16 through an int16 view, as
    ml_dtypes'), cupy for a CUDA tensor. ``what`` names the tensor in errors."""
    device = tensor.device.type
    if device == "cuda":
        return _cuda_view(tensor, what)
    if device != "cpu":
        raise ValueError(f"paramplane moves CPU and CUDA tensors; {what} is on {tensor.device}")
    try:
        view = torch_cpu_view(tensor)
    except (BufferError, TypeError, RuntimeError) as exc:
        raise ValueError(f"{what} ({tensor.dtype}) cannot be seen by numpy: {exc}") from None
    if not is_moved(view.dtype):
        raise ValueError(
            f"{what} is {tensor.dtype}, which the plane does not move; use one of {', '.join(DTYPES)}"
        )
    return view


def _cuda_view(tensor: Any, what: str) -> Any:
    try:
        import cupy
    except ImportError:
        raise ValueError(
            f"{what} is on {tensor.device}: CUDA tensors need cupy (pip install 'paramplane[gpu]')"
        ) from None
    if str(tensor.dtype) == "torch.bfloat16":
        raise ValueError(
            f"{what} is torch.bfloat16 on {tensor.device}, which cupy cannot hold; keep CUDA parameters in "
            "float32 or float16 (torch.autocast computes in bfloat16 all the same)"
        )
    with torch_stream(tensor):  # DLPack's producer waits are then on one stream: no synchronisation
        view = cupy.from_dlpack(tensor.detach())
    if not is_moved(view.dtype):
        raise ValueError(
            f"{what} is {tensor.dtype}, which the plane does not move; use one of {', '.join(DTYPES)}"
        )
    return view


def clip_grads_to(grads: Any, norm: Any, max_norm: float) -> None:
    """Scale the gradient tensors ``grads`` in place as ``torch.nn.utils.clip_grad_norm_`` does once it has
    their total ``norm`` (a tensor): by ``max_norm / (norm + 1e-6)`` where that is below 1."""
    import torch

    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))


def to_tensor(array: Any) -> Any:
    """A zero-copy torch tensor over a numpy array (``to_torch``) or a cupy array (DLPack, same device)."""
    if isinstance(array, np.ndarray):
        return to_torch(array)
    import torch

    return torch.from_dlpack(array)


@contextlib.contextmanager
def torch_stream(tensor: Any) -> Iterator[None]:
    """For a CUDA ``tensor``: its device, with torch's current stream as cupy's current stream (where the
    plane's NCCL collectives are enqueued), inside; for a CPU tensor nothing changes."""
    if tensor.device.type != "cuda":
        yield
        return
    import cupy
    import torch

    stream = torch.cuda.current_stream(tensor.device)
    with cupy.cuda.Device(tensor.device.index or 0), cupy.cuda.ExternalStream(stream.cuda_stream):
        yield


class CommStream:
    """A CUDA stream beside torch's current one for collectives that overlap the backward, as torch's NCCL
    process group keeps one: ``issue()`` makes it wait for what torch's current stream has enqueued so far (the
    gradients packed into a bucket) and makes it cupy's current stream inside (where the plane's NCCL ops are
    enqueued); ``join()`` makes torch's current stream wait for everything issued on it. The backward's kernels
    then never queue behind an all-reduce that waits for a peer (on one stream they would, bucket by bucket).
    Arrays used on both streams must outlive the ``join()`` (DDP's buckets live as long as the wrapper)."""

    def __init__(self, tensor: Any) -> None:
        import torch

        self.device = tensor.device
        self.stream = torch.cuda.Stream(self.device)

    @contextlib.contextmanager
    def issue(self) -> Iterator[None]:
        import cupy
        import torch

        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with cupy.cuda.Device(self.device.index or 0), cupy.cuda.ExternalStream(self.stream.cuda_stream):
            yield

    def join(self) -> None:
        import torch

        torch.cuda.current_stream(self.device).wait_stream(self.stream)


class TorchParam:
    """One torch parameter with the interface DDP's buckets use (``data``, ``grad``, grad hooks)."""

    def __init__(self, name: str, tensor: Any) -> None:
        self.name = name
        self.tensor = tensor
        self.data = to_array(tensor, f"parameter {name!r}")
        self.requires_grad = bool(tensor.requires_grad)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.data.dtype

    @property
    def size(self) -> int:
        return int(self.data.size)

    @property
    def grad(self) -> Any:
        g = self.tensor.grad
        return None if g is None else to_array(g, f"the gradient of {self.name!r}")

    @grad.setter
    def grad(self, value: Any) -> None:
        if value is not None:
            value = to_tensor(value if value.flags.c_contiguous else value.copy())
        self.tensor.grad = value

    def register_grad_hook(self, fn: Callable[[TorchParam], None]) -> Any:
        return self.tensor.register_post_accumulate_grad_hook(lambda _t: fn(self))

    def register_grad_pre_hook(self, fn: Callable[[TorchParam], None]) -> Any:
        """``fn(param)`` when a backward has computed a gradient for it, before torch adds it to ``grad``."""

        def hook(grad: Any) -> None:
            fn(self)

        return self.tensor.register_hook(hook)


class TorchFlatParam(TorchParam):
    """A torch parameter whose values FSDP re-points: assigning ``data`` swaps the tensor's data.

    A writable array becomes the tensor's data zero-copy (a view into the unit's gathered flat buffer);
    a read-only one is FSDP's sharded placeholder and becomes a zero-stride tensor of NaNs of the same
    shape (one element of memory), so a computation that reads a sharded parameter yields NaN, never
    plausible values. (A storage-free tensor, as torch's FSDP leaves, raises in matmuls but crashes the
    process in elementwise ops and reductions on CPU.) Autograd keeps the tensor object, so a backward
    after re-gathering sees the gathered values again.
    """

    @property
    def data(self) -> Any:
        return self._data

    @data.setter
    def data(self, value: Any) -> None:
        self._data = value
        if not isinstance(value, np.ndarray):  # cupy: a view, or FSDP's zero-stride NaN placeholder, as it is
            self.tensor.data = to_tensor(value)
        elif value.flags.writeable:
            self.tensor.data = to_torch(value)
        else:
            self.tensor.data = to_torch(np.full((), np.nan, value.dtype)).expand(value.shape)


def check_wrappable(module: Any, wrapper: str) -> None:
    """Refuse, before any communication, what the wrappers cannot take: parameters a lazy module has not made
    yet (torch's DDP refuses them too), embeddings with sparse gradients (not reduced here), and torch's
    ``SyncBatchNorm`` layers where torch.distributed is not initialised (they would silently normalise each
    rank's batch alone, where the script asked for the whole batch's statistics)."""
    import torch

    for name, p in module.named_parameters():
        if isinstance(p, torch.nn.parameter.UninitializedParameter):
            raise ValueError(
                f"{wrapper}: parameter {name!r} is not initialised yet (a lazy module): run a forward pass on a "
                "sample input before wrapping, as torch's DDP asks"
            )
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.Embedding | torch.nn.EmbeddingBag) and m.sparse:
            raise ValueError(
                f"{wrapper}: {name!r} has sparse=True, whose sparse gradients {wrapper} does not reduce: use "
                "sparse=False (dense gradients)"
            )
        if type(m) is torch.nn.SyncBatchNorm and not torch.distributed.is_initialized():
            raise ValueError(
                f"{wrapper}: {name or 'the module'!r} is torch's SyncBatchNorm, which synchronises only over an "
                "initialised torch.distributed (none here): it would normalise each rank's batch alone. Convert "
                "with pp.convert_sync_batchnorm(model, world.group) before wrapping (it takes torch's "
                "SyncBatchNorm layers too)"
            )


class TensorMap:
    """Values keyed by torch tensors by identity, holding the tensors weakly: an entry goes when its tensor does.
    (A dict keyed by the tensors would compare them elementwise; an attribute on a tensor would follow it into
    ``copy.deepcopy`` and stop ``torch.save`` from pickling it.)"""

    def __init__(self) -> None:
        self._items: dict[int, tuple[weakref.ref[Any], Any]] = {}

    def __setitem__(self, tensor: Any, value: Any) -> None:
        key = id(tensor)

        def forget(_ref: weakref.ref[Any]) -> None:
            self._items.pop(key, None)

        self._items[key] = (weakref.ref(tensor, forget), value)

    def get(self, tensor: Any) -> Any:
        """``tensor``'s value, or None."""
        entry = self._items.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else None

    def pop(self, tensor: Any) -> None:
        if self.get(tensor) is not None:
            del self._items[id(tensor)]


_owners = TensorMap()  # a wrapped parameter -> (a weak reference to its wrapper, the wrapper's kind)


def _owner(p: Any) -> tuple[Any, str]:
    """The live wrapper holding parameter ``p``, and its kind (None, "" if none)."""
    entry = _owners.get(p)
    return (None, "") if entry is None else (entry[0](), entry[1])


def claim_parameters(module: Any, wrapper: Any, kind: str) -> list[Any]:
    """Mark ``module``'s parameters as ``wrapper``'s (``kind``: "pp.DDP" or "pp.FSDP") and return the live
    pp.DDP wrappers that held some of them (the caller supersedes those). A parameter a live pp.FSDP holds is a
    ValueError, as is pp.FSDP over parameters a live pp.DDP holds: the FSDP's parameters are views of its own
    buffers (placeholders while sharded), so a second wrapper would read and broadcast those, and both would
    hook the same gradients (torch FSDP2's ``fully_shard`` per block then on the root is one pp.FSDP at the
    root: its default units are the blocks)."""
    previous: dict[int, Any] = {}
    for name, p in module.named_parameters():
        held, held_kind = _owner(p)
        if held is None or held is wrapper:
            continue
        if held_kind == "pp.FSDP" or kind == "pp.FSDP":
            raise ValueError(
                f"{kind}: parameter {name!r} is already wrapped by a {held_kind}: wrap the model once (one pp.FSDP "
                "at the root shards every block: its default units are the blocks, as FSDP2's fully_shard per "
                "block; call remove_hooks() on a pp.DDP to wrap its module again)"
            )
        previous[id(held)] = held
    mine = weakref.ref(wrapper)
    for p in module.parameters():
        _owners[p] = (mine, kind)
    return list(previous.values())


def release_parameters(module: Any, wrapper: Any) -> None:
    """``wrapper`` no longer holds ``module``'s parameters (its hooks are removed)."""
    for p in module.parameters():
        if _owner(p)[0] is wrapper:
            _owners.pop(p)


def frozen_tensors(module: Any) -> list[tuple[str, Any]]:
    """The module's parameters that do not require grad (at wrap time: see ``check_still_frozen``)."""
    return [(name, p) for name, p in module.named_parameters() if not p.requires_grad]


def check_still_frozen(frozen: list[tuple[str, Any]], wrapper: str) -> None:
    """Raise if a parameter frozen when ``wrapper`` took the module has a gradient now (it was unfrozen after
    wrapping, as a fine-tuning loop does after a few epochs): the wrapper does not synchronise it, as torch's
    own do not (they register parameters once), so each rank would step it with its own gradient."""
    for name, tensor in frozen:
        if tensor.grad is not None:
            raise RuntimeError(
                f"{wrapper}: parameter {name!r} did not require grad when the module was wrapped and now has a "
                f"gradient, which {wrapper} does not synchronise (torch's wrappers neither): each rank would step "
                "it alone and the ranks' models would part. Set requires_grad as it will be before wrapping (a "
                "parameter trainable at wrap time may be frozen later: it is then taken as unused)."
            )


def torch_params(module: Any) -> list[TorchParam]:
    return [TorchParam(name, p) for name, p in module.named_parameters()]


def torch_buffers(module: Any) -> list[tuple[str, np.ndarray]]:
    return [(name, to_array(b, f"buffer {name!r}")) for name, b in module.named_buffers()]
