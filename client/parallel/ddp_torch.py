"""What ``DDP`` composes per kind of module: ``TorchPath`` for a ``torch.nn.Module``, ``NNPath`` for a
``paramplane.nn.Module``.

The wrapper (``ddp.py``) owns the buckets and the collectives; a path says how to see the module's
parameters and buffers, how to call it, when buffers are re-broadcast, what a synchronised backward's
gradient hook does beyond filling buckets, and which optimizers ``attach`` takes.

``TorchPath`` follows ``torch.nn.parallel.DistributedDataParallel``: ``ddp(*args, **kwargs)`` is
``module(*args, **kwargs)``, whatever it returns; the first gradient hook of a synchronised backward queues
the gradient sync as an autograd callback (as torch's reducer does), so every ``.grad`` is averaged when
``loss.backward()`` returns; buffers are broadcast from rank 0 before a forward when the previous forward ran
with grad enabled outside ``no_sync`` (torch's ``require_forward_param_sync``; true before the first); and,
as torch's reducer decides when the forward runs, a backward synchronises when the last forward with grad
enabled ran outside ``no_sync`` (where the backward runs does not matter).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any, Protocol, cast

from paramplane.nn.module import Array, Module, Parameter
from paramplane.optim.optimizer import Optimizer
from paramplane.parallel.torch_params import (
    CommStream,
    EndOfBackward,
    check_still_frozen,
    check_wrappable,
    frozen_tensors,
    output_tensors,
    torch_buffers,
    torch_params,
    torch_stream,
)

__all__ = ["ModulePath", "NNPath", "TorchPath"]


class ModulePath(Protocol):
    module: Any

    def params(self) -> list[Parameter]: ...

    def buffers(self) -> list[Array]: ...

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any], no_sync: bool) -> Any:
        """Run the module's forward (``no_sync``: inside ``DDP.no_sync()``)."""
        ...

    def syncs_buffers(self, no_sync: bool) -> bool:
        """Whether the forward about to run first takes rank 0's buffers."""
        ...

    def syncs_backward(self, no_sync: bool) -> bool:
        """Whether a gradient arriving now takes part in a synchronised backward."""
        ...

    def on_grad(self, finish: Callable[[], None]) -> None:
        """A synchronised backward produced a gradient; ``finish`` completes the sync."""
        ...

    def attach(self, optimizer: Any, finish: Callable[[], None]) -> Any: ...

    def stream(self) -> contextlib.AbstractContextManager[None]:
        """Where the wrapper's collectives are enqueued: torch's current stream for a CUDA module."""
        ...

    def comm_stream(self) -> contextlib.AbstractContextManager[None]:
        """Where a bucket's all-reduce is enqueued (inside ``stream()``): beside the backward for a CUDA module
        (after what the current stream enqueued so far), else where ``stream()`` puts it."""
        ...

    def join_comm(self) -> None:
        """Make the current stream wait for every all-reduce enqueued through ``comm_stream()``."""
        ...


class NNPath:
    """A ``paramplane.nn.Module``: ``forward(x)``/``backward(grad)``; the sync finishes in ``attach``'s hook
    (or an explicit ``finish_gradient_sync()``); buffers follow rank 0 on training forwards outside
    ``no_sync``."""

    def __init__(self, module: Module) -> None:
        self.module = module

    def params(self) -> list[Parameter]:
        return self.module.parameters()

    def buffers(self) -> list[Array]:
        return [b for _, b in self.module.named_buffers()]

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any], no_sync: bool) -> Any:
        return self.module.forward(*args, **kwargs)

    def syncs_buffers(self, no_sync: bool) -> bool:
        return self.module.training and not no_sync

    def syncs_backward(self, no_sync: bool) -> bool:
        return not no_sync

    def on_grad(self, finish: Callable[[], None]) -> None:
        pass  # no autograd engine to call back: the optimizer's step (attach) or the caller finishes

    def attach(self, optimizer: Any, finish: Callable[[], None]) -> Any:
        if not isinstance(optimizer, Optimizer):
            raise ValueError(f"attach() takes a paramplane.optim optimizer, got {type(optimizer).__name__}")
        return optimizer.register_step_pre_hook(lambda _opt: finish())

    def stream(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def comm_stream(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # cupy arrays: the caller's current stream, as every plane op

    def join_comm(self) -> None:
        pass


class TorchPath:
    """A ``torch.nn.Module`` (CPU or CUDA tensors through DLPack views: numpy or cupy), with torch DDP's
    semantics (module docstring); on CUDA the collectives run on torch's current stream (``stream``)."""

    def __init__(self, module: Any) -> None:
        check_wrappable(module, "pp.DDP")
        self.module = module
        self._sync_next_forward = True  # torch's require_forward_param_sync
        self._sync_backward = True  # whether the last forward with grad enabled ran outside no_sync
        self._finish: Callable[[], None] | None = None  # the DDP's, given with the first gradient
        self._end_of_backward = EndOfBackward(self._finish_sync)
        self._frozen = frozen_tensors(module)
        anchor = next(iter(module.parameters()), None)
        self._cuda_anchor = anchor if anchor is not None and anchor.device.type == "cuda" else None
        self._comm = CommStream(anchor) if self._cuda_anchor is not None else None

    def params(self) -> list[Parameter]:
        # Duck-typed Parameters: DLPack views of the tensors, torch's post-accumulate-grad hooks.
        return cast(list[Parameter], torch_params(self.module))

    def buffers(self) -> list[Array]:
        return [b for _, b in torch_buffers(self.module)]

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any], no_sync: bool) -> Any:
        import torch

        grad_enabled = torch.is_grad_enabled()
        self._end_of_backward.reset()
        out = self.module(*args, **kwargs)
        self._sync_next_forward = grad_enabled and not no_sync
        if grad_enabled:
            self._sync_backward = not no_sync
            if not no_sync:
                # the sync's end is requested from the outermost backward, which the output starts (before a
                # reentrant checkpoint's nested backward produces the first gradient)
                for t in output_tensors(out):
                    if t.requires_grad:
                        t.register_hook(lambda _g: self._request())
        return out

    def _request(self) -> None:
        if self._sync_backward:
            self._end_of_backward.request()

    def _finish_sync(self) -> None:
        if self._finish is not None:
            self._finish()
        check_still_frozen(self._frozen, "pp.DDP")

    def syncs_buffers(self, no_sync: bool) -> bool:
        return self._sync_next_forward

    def syncs_backward(self, no_sync: bool) -> bool:
        return self._sync_backward

    def on_grad(self, finish: Callable[[], None]) -> None:
        self._finish = finish
        self._end_of_backward.request()  # finish runs when this backward ends, before loss.backward() returns

    def attach(self, optimizer: Any, finish: Callable[[], None]) -> Any:
        torch = sys.modules.get("torch")
        if (
            isinstance(optimizer, Optimizer)
            or torch is None
            or not isinstance(optimizer, torch.optim.Optimizer)
        ):
            raise ValueError(f"attach() takes a torch.optim optimizer, got {type(optimizer).__name__}")
        return optimizer.register_step_pre_hook(lambda _opt, _args, _kwargs: finish())

    def stream(self) -> contextlib.AbstractContextManager[None]:
        # torch's current stream is read at each call (a caller may switch streams between steps)
        return torch_stream(self._cuda_anchor) if self._cuda_anchor is not None else contextlib.nullcontext()

    def comm_stream(self) -> contextlib.AbstractContextManager[None]:
        return self._comm.issue() if self._comm is not None else contextlib.nullcontext()

    def join_comm(self) -> None:
        if self._comm is not None:
            self._comm.join()


_COMPRESS_HOOKS = {"fp16_compress_hook": "float16", "bf16_compress_hook": "bfloat16"}


def comm_hook_dtype(hook: Any) -> str:
    """The ``comm_dtype`` that torch's compression hook ``hook`` stands for (``DDP.register_comm_hook``):
    ``fp16_compress_hook`` / ``bf16_compress_hook`` of ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``.
    Any other hook (PowerSGD, a user's) runs on a torch process group's buckets: a NotImplementedError."""
    name = getattr(hook, "__name__", repr(hook))
    module = getattr(hook, "__module__", "") or ""
    if name in _COMPRESS_HOOKS and module.startswith("torch.distributed.algorithms.ddp_comm_hooks"):
        return _COMPRESS_HOOKS[name]
    raise NotImplementedError(
        f"pp.DDP.register_comm_hook takes torch's fp16_compress_hook and bf16_compress_hook (as "
        f"comm_dtype='float16' / 'bfloat16'), not {module}.{name}: other hooks run on a torch process group"
    )


def torch_ddp_keywords(
    *,
    broadcast_buffers: bool | None,
    forward_sync_buffers: bool | None,
    static_graph: bool,
    dim: int,
    check_reduction: bool,
    skip_all_reduce_unused_params: bool,
    batched_grad_copy: bool,
    unsupported: dict[str, Any],
) -> tuple[bool, bool]:
    """torch DDP's keywords beyond the group and the buckets: ValueErrors for wrong types and for what pp.DDP
    cannot honour (``unsupported``, named), else (buffers broadcast at wrap time, buffers broadcast before
    forwards) by torch 2.13's rule: ``forward_sync_buffers`` decides the forwards and leaves the wrap-time
    broadcast on; ``broadcast_buffers`` (its older name, True when neither is given) decides both.

    The rest change nothing here: ``static_graph`` (usage is found every step), ``dim`` (torch scatters inputs
    over a module's several devices by it; a rank has one), ``check_reduction`` (deprecated by torch, which
    ignores it), ``batched_grad_copy`` (how torch's CUDA reducer copies into buckets), and
    ``skip_all_reduce_unused_params`` (torch then leaves a parameter unused on every rank without a reduced
    gradient, and requires the same unused set on every rank: pp.DDP keeps such a parameter's ``grad`` None
    anyway, and averages one unused on some ranks only with zeros, where torch's may hang)."""
    flags: dict[str, bool | None] = {
        "static_graph": static_graph,
        "check_reduction": check_reduction,
        "skip_all_reduce_unused_params": skip_all_reduce_unused_params,
        "batched_grad_copy": batched_grad_copy,
        "broadcast_buffers": broadcast_buffers,
        "forward_sync_buffers": forward_sync_buffers,
    }
    for name, value in flags.items():
        if not isinstance(value, bool) and not (value is None and name.endswith("_buffers")):
            raise ValueError(f"{name} must be a bool, got {value!r}")
    if type(dim) is not int:
        raise ValueError(f"dim must be an int, got {dim!r}")
    if unsupported.get("mixed_precision") is not None:
        raise ValueError(
            "DDP: mixed_precision (torch DDP's private _MixedPrecision) is not supported: compute in lower "
            "precision under torch.autocast, and pass comm_dtype='bfloat16' for compressed gradients"
        )
    named = sorted(k for k, v in unsupported.items() if v is not None)
    if named:
        raise ValueError(
            f"DDP: {', '.join(named)} not supported (pp.DDP reduces every trainable parameter in buckets as its "
            "gradients come; a parameter's reduction cannot be delayed to another's hook)"
        )
    if forward_sync_buffers is not None:
        return True, forward_sync_buffers
    both = True if broadcast_buffers is None else broadcast_buffers
    return both, both
