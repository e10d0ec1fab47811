"""DDP's communication helpers: bucket assignment, flat bucket buffers, batch sharding, and the broadcast of
replicated state (DDP's and FSDP's buffers).

A bucket is one flat array holding the gradients of several parameters of one
dtype and array library, followed by one "used" flag per parameter (1 where
this rank produced a gradient, else 0). After the all-reduce a flag above zero
says some rank produced one, so a parameter that no rank touched keeps
``grad = None`` on every rank, exactly as in a single process.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from paramplane.group import ProcessGroup
from paramplane.nn.module import Array, Parameter
from paramplane.node.arrays import array_module
from paramplane.node.spec import split_bounds
from paramplane.work import Work

MIB = 1 << 20
DEFAULT_BUCKET_MB = 25.0
"""DDP's bucket size when none is given (torch DDP's ``bucket_cap_mb`` default)."""
FIRST_BUCKET_BYTES = MIB
"""The first bucket's size at the default bucket size (torch's ``_DEFAULT_FIRST_BUCKET_BYTES``)."""
COMM_DTYPES = (None, "bfloat16", "float16")
"""Wire dtypes of gradient compression (DDP's buckets, FSDP's inter-host all-reduce), like torch's
``bf16_compress_hook`` / ``fp16_compress_hook``."""


def broadcast_arrays(
    group: ProcessGroup, arrays: Sequence[Any], bucket_bytes: int = 25 * MIB, src: int = 0
) -> None:
    """Overwrite each array in place with group rank ``src``'s, coalesced as torch's ``_broadcast_coalesced``: arrays
    of one dtype and library share flat buffers of about ``bucket_bytes`` (one broadcast each, not one per
    array: a ResNet's 60 BatchNorm buffers are two broadcasts); an array alone in its buffer and contiguous is
    broadcast in place."""
    arrays = list(arrays)
    keyed = [((array_module(a).__name__, a.dtype.str), int(a.nbytes)) for a in arrays]
    for indices in bucket_by_size(keyed, bucket_bytes):
        only = arrays[indices[0]]
        if len(indices) == 1 and only.flags.c_contiguous:
            group.broadcast(only, src=src)
            continue
        xp = array_module(only)
        flat = xp.concatenate([arrays[i].reshape(-1) for i in indices])
        group.broadcast(flat, src=src)
        start = 0
        for i in indices:
            a = arrays[i]
            a[...] = flat[start : start + a.size].reshape(a.shape)
            start += a.size


@functools.cache
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> bool:
    """Return the memory freed on the C heap to the OS (glibc's ``malloc_trim(0)``, which also releases free
    pages inside the heap); False where the C library has no such call. Freed blocks below the trim threshold
    (the launcher's 64 MiB) otherwise stay resident, a one-off temporary's included."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


_MADV_NOHUGEPAGE = 15  # Linux
_PAGE = 4096
_HUGE = 2 * MIB


@functools.cache
def _madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def host_buffer(num_elements: int, dtype: Any, *, zeroed: bool = False) -> np.ndarray[Any, Any]:
    """``numpy.empty`` (``zeroed``: ``numpy.zeros``, still untouched) for a buffer made anew every step, without
    transparent huge pages. numpy asks the kernel for huge pages on every allocation of 4 MiB or more
    (``MADV_HUGEPAGE``); for a buffer that is freed and made again each step, each 2 MiB first touch then costs a
    huge-page fault (which, at the kernel's default ``defrag`` setting, may compact memory synchronously): that
    made pp.DDP's CPU per step 1.2x torch DDP's at four ranks on two cores against 1.03x without (GPT-2,
    torch_models.py). torch's CPU tensors do not ask for huge pages."""
    out = np.zeros(num_elements, dtype) if zeroed else np.empty(num_elements, dtype)
    madvise = _madvise()
    if madvise is not None and out.nbytes >= _HUGE:
        start = -(-out.ctypes.data // _PAGE) * _PAGE
        stop = (out.ctypes.data + out.nbytes) // _PAGE * _PAGE
        madvise(start, stop - start, _MADV_NOHUGEPAGE)  # advice only: a failure leaves numpy's
    return out


def shard_range(num_items: int, num_shards: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of shard ``index`` of ``num_items`` split like ``numpy.array_split``.

    The first ``num_items % num_shards`` shards hold one item more. Every shard must be
    non-empty (a rank without data would skip its backward and the collectives with it),
    so ``num_items < num_shards`` is a ValueError.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index {index} is not in [0, {num_shards})")
    if num_items < num_shards:
        raise ValueError(
            f"cannot split {num_items} items over {num_shards} ranks: every rank needs at least one; "
            "use a larger global batch"
        )
    return split_bounds(num_items, num_shards)[index]


def assign_buckets(
    params: Sequence[Parameter], bucket_bytes: int | Sequence[int], first_bucket_bytes: int | None = None
) -> list[list[int]]:
    """Indices of ``params`` per bucket: reverse order (the order backward produces their gradients), one dtype
    and array library per bucket, by :func:`bucket_by_size`: torch DDP's rule, the first bucket of each kind
    closing at ``first_bucket_bytes`` (torch's small first bucket that starts the last layers' all-reduce
    early), or each bucket at its own limit for a sequence (torch's ``bucket_cap_mb_list``). Every rank with
    the same model gets the same list."""
    walk = list(reversed(range(len(params))))
    keyed = [
        (
            (array_module(params[i].data).__name__, params[i].dtype.str),
            params[i].size * params[i].dtype.itemsize,
        )
        for i in walk
    ]
    return [[walk[j] for j in bucket] for bucket in bucket_by_size(keyed, bucket_bytes, first_bucket_bytes)]


def bucket_by_size(
    items: Sequence[tuple[Hashable, int]],
    bucket_bytes: int | Sequence[int],
    first_bucket_bytes: int | None = None,
) -> list[list[int]]:
    """Indices of ``items`` (each a (kind, bytes) pair) per bucket, by torch's rule
    (``torch.distributed._compute_bucket_assignment_by_size``): walking the items in order, each kind keeps
    one open bucket, which closes once it holds ``bucket_bytes`` or more; the item that reaches the limit stays
    in it, so a bucket exceeds the limit by less than its last item. The first bucket of each kind closes at
    ``first_bucket_bytes`` instead (default: ``bucket_bytes``). A sequence of limits gives each kind's n-th
    bucket the n-th limit, the last one for every bucket after (torch's list of limits). Buckets are ordered by
    their first item."""
    if isinstance(bucket_bytes, int):
        caps = [bucket_bytes] if first_bucket_bytes is None else [first_bucket_bytes, bucket_bytes]
    else:
        if first_bucket_bytes is not None:
            raise ValueError("bucket sizes: give a list of limits or a first bucket's size, not both")
        caps = list(bucket_bytes)
    if not caps or min(caps) < 1:
        raise ValueError(f"bucket sizes must be positive, got {caps} bytes")
    done: list[list[int]] = []
    open_: dict[Hashable, list[int]] = {}
    sizes: dict[Hashable, int] = {}
    closed: dict[Hashable, int] = {}  # per kind: buckets closed so far
    for j, (key, nbytes) in enumerate(items):
        open_.setdefault(key, []).append(j)
        sizes[key] = sizes.get(key, 0) + nbytes
        n = closed.get(key, 0)
        if sizes[key] >= caps[min(n, len(caps) - 1)]:
            done.append(open_.pop(key))
            sizes[key] = 0
            closed[key] = n + 1
    done.extend(open_.values())
    done.sort(key=lambda b: b[0])
    return done


@dataclass
class Bucket:
    """One flat gradient buffer over ``params`` (indices into the DDP's parameter list)."""

    index: int
    params: list[int]
    offsets: list[tuple[int, int]]
    storage: Array | None
    """The flat buffer (``flat``); None once :meth:`hand_over` gave it to the gradients, until the next round
    takes a new one."""
    fired: list[int] = field(default_factory=list)
    """Grad-hook calls per parameter in the current round."""
    waiting: int = 0
    """Parameters still short of their expected hook calls this round (DDP keeps it; 0: ready to launch)."""
    work: Work[Any] | None = None
    """The all-reduce in flight (None before launch and after finish)."""
    launched: bool = False
    wire: Array | None = None
    """What the all-reduce in flight moves: ``flat`` itself, or its copy in the compression dtype."""
    missing: list[int] = field(default_factory=list)
    """Parameters packed without a gradient this round (then the flags, summed over ranks, are read back)."""

    def __post_init__(self) -> None:
        assert self.storage is not None
        self._xp: ModuleType = array_module(self.storage)
        self._dtype = self.storage.dtype
        self.on_host = isinstance(self.storage, np.ndarray)

    @classmethod
    def build(cls, index: int, indices: list[int], all_params: Sequence[Parameter]) -> Bucket:
        first = all_params[indices[0]]
        xp: ModuleType = array_module(first.data)
        offsets = []
        start = 0
        for i in indices:
            offsets.append((start, start + all_params[i].size))
            start += all_params[i].size
        if xp is np:
            flat = host_buffer(start + len(indices), first.dtype, zeroed=True)
        else:
            flat = xp.zeros(start + len(indices), dtype=first.dtype)
        return cls(index, list(indices), offsets, flat, [0] * len(indices), len(indices))

    @property
    def flat(self) -> Array:
        """The flat buffer: gradients, then one flag per parameter. After :meth:`hand_over`, a new one (not
        zeroed: a round writes every element in :meth:`pack` and :meth:`seal` before it reads any)."""
        if self.storage is None:
            size = self.num_elements + len(self.params)
            self.storage = (
                host_buffer(size, self._dtype) if self.on_host else self._xp.empty(size, self._dtype)
            )
        return self.storage

    def hand_over(self) -> None:
        """Leave the buffer to the gradients that are views of it: the bucket takes a new one when its next
        round packs, so the gradients are held once and no later round writes into them."""
        self.storage = None

    @property
    def num_elements(self) -> int:
        return int(self.offsets[-1][1])

    def slot(self, k: int) -> Array:
        a, b = self.offsets[k]
        return self.flat[a:b]

    def pack(self, k: int, grad: Array | None, scale: float | None = None) -> None:
        """Copy one parameter's gradient (or zeros when it has none) into the buffer, times ``scale`` if given
        (a mean's ``1/n`` applied in the copy, as torch's reducer does, instead of in a pass of its own after
        the sum); :meth:`seal` flags them. A gradient that is this slot already (``gradient_as_bucket_view``)
        is not copied, only scaled."""
        view = self.slot(k)
        if grad is None:
            view[...] = 0
            self.missing.append(k)
        elif self.holds(k, grad):
            if scale is not None:
                view *= scale
        elif scale is None:
            view[...] = grad.reshape(-1)
        else:
            self._xp.multiply(grad.reshape(-1), scale, out=view)

    def holds(self, k: int, array: Array) -> bool:
        """Whether ``array`` is slot ``k`` itself (a view of it, as a gradient kept as a bucket view is)."""
        return bool(_address(array) == _address(self.slot(k)) and array.size == self.slot(k).size)

    def seal(self) -> None:
        """Flag which parameters had a gradient, once all are packed: one fill in the usual round where every
        one had (no kernel per parameter on a GPU)."""
        self.flat[self.num_elements :] = 1
        for k in self.missing:
            self.flat[self.num_elements + k] = 0

    def unpack(self, all_params: Sequence[Parameter], as_view: bool = False) -> None:
        """Write the reduced gradients back: into ``p.grad`` in place, or as a new array (``as_view``: a view of
        the slot, which a gradient already kept as one needs no write). With every gradient present here the
        reduced flags are all positive, so they are not read back (no device sync)."""
        flags = np.asarray(_host(self.flat[self.num_elements :])) > 0 if self.missing else None
        for k, i in enumerate(self.params):
            if flags is not None and not flags[k]:
                continue
            p = all_params[i]
            value = self.slot(k).reshape(p.shape)
            grad = p.grad  # one view of it (a torch gradient's is a DLPack view, made per access)
            if grad is not None and self.holds(k, grad):
                continue
            if grad is None or tuple(grad.shape) != p.shape:
                p.grad = value if as_view else value.copy()
            else:
                grad[...] = value

    def reset(self) -> None:
        self.fired = [0] * len(self.params)
        self.waiting = len(self.params)
        self.work = None
        self.wire = None
        self.launched = False
        self.missing.clear()


def _address(x: Array) -> int:
    """Where an array's first element lies (numpy or cupy)."""
    return int(x.__array_interface__["data"][0]) if isinstance(x, np.ndarray) else int(x.data.ptr)


def _host(x: Array) -> Any:
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else x
