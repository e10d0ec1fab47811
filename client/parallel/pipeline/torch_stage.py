"""torch stage modules in a ``Pipeline``: autograd inside each stage, tensors across stages through DLPack.

``TorchStage`` gives a ``torch.nn.Module`` the interface the pipeline's executor drives (``forward`` of one
microbatch, its state kept for ``backward``). A forward runs the module with autograd on a tensor that views
the received array (``torch.from_numpy``: no copy on CPU; on the host the receiver thread makes it, a leaf that
requires its gradient, while the stage still computes: ``received``) and keeps the graph of that microbatch;
what it sends is a zero-copy view of its output (``torch_params.to_array``). The backward runs
``torch.autograd.backward`` (on CPU the autograd engine's call it makes) from the received output gradient (or
from the last stage's loss) and sends the input's gradient. Parameters' ``.grad`` accumulate over microbatches,
as in torch's schedules.

Loss scaling follows torch's ``scale_grads=True`` (the default of ``torch.distributed.pipelining``'s
schedules, which divide the stage gradients by the number of microbatches after the step): each
microbatch's loss gradient is multiplied by ``1 / microbatches`` instead, which gives the same gradients and
leaves gradients accumulated before the step as they were. Reported losses are the unscaled ones, read as
floats after the step (not between two computes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from paramplane.group import ProcessGroup
from paramplane.parallel.torch_params import TorchParam, clip_grads_to, to_array, to_tensor

STAGE_ATTR = "_paramplane_stage"
"""Where ``pipeline_split`` leaves a stage's ``StageInfo`` on its module."""


class TorchStage:
    """One torch stage module (``call`` runs it: the module, or a wrapper around it) as the executor's unit.

    ``first``: its input is the batch (no gradient is sent back for it); ``kwargs[mb]`` are the keyword
    arguments of microbatch ``mb`` (set by the pipeline before each step)."""

    def __init__(self, module: Any, call: Callable[..., Any], first: bool, fsdp: Any = None) -> None:
        self.module = module
        self.call = call
        self.first = first
        self.fsdp = fsdp
        """The ``pp.FSDP`` around ``module`` (``call``), if any: the optimizer steps its shards."""
        self.kwargs: Sequence[Mapping[str, Any]] = ()
        self.train = True
        self._state: tuple[Any, Any] | None = None
        self._scale: tuple[Any, Any] | None = None  # the loss gradient ``loss`` starts backward from

    def forward(self, x: Any, mb: int) -> Any:
        """Run microbatch ``mb`` on ``x`` (a tuple: the previous stage's several outputs, passed as positional
        arguments); keeps (input, output) for the backward; returns the output."""
        import torch

        kwargs = self.kwargs[mb] if self.kwargs else {}
        if isinstance(x, (tuple, list)):
            inp: Any = tuple(self._input(v) for v in x)
            args = inp
        else:
            inp = self._input(x)
            args = (inp,)
        if torch.is_grad_enabled() == self.train:
            out = self.call(*args, **kwargs)
        else:
            with torch.set_grad_enabled(self.train):
                out = self.call(*args, **kwargs)
        self._state = (inp, out)
        return out

    def _input(self, x: Any) -> Any:
        """``x`` as the tensor a forward takes: a floating-point input of a later stage, when training, a leaf
        that requires its gradient (the gradient sent back)."""
        import torch

        inp = x if torch.is_tensor(x) else to_tensor(x)
        if (
            self.train
            and not self.first
            and inp.is_floating_point()
            and not (inp.requires_grad and inp.is_leaf)
        ):
            inp = inp.detach().requires_grad_(True)
        return inp

    def outgoing(self, out: Any, where: str) -> Any:
        """A stage's output as what crosses to the next stage: an array (a view, no copy), or a tuple of them
        for a tuple (or list) of tensors, which the next stage's forward takes as positional arguments."""
        import torch

        if torch.is_tensor(out):
            return to_array(out.detach(), f"the output of {where}")
        if isinstance(out, (tuple, list)) and out and all(torch.is_tensor(t) for t in out):
            return tuple(to_array(t.detach(), f"output {i} of {where}") for i, t in enumerate(out))
        raise ValueError(
            f"{where} returned {_describe(out)}: a stage that feeds another stage must return a tensor or a "
            "tuple of tensors"
        )

    def loss(self, loss_fn: Callable[..., Any], target: Any, scale: float) -> Any:
        """The last stage: the loss of the output kept by ``forward``, detached (a scalar tensor: the pipeline
        reads its value after the step, not between two computes). Its backward runs at the schedule's
        backward of this microbatch, from the loss with gradient ``scale``: the gradients of ``loss * scale``
        without a multiplication in the graph."""
        import torch

        assert self._state is not None
        inp, out = self._state
        tgt = target if torch.is_tensor(target) else to_tensor(target)
        value = loss_fn(out, tgt)
        if not torch.is_tensor(value) or value.numel() != 1:
            raise ValueError("the pipeline's loss_fn must return a scalar tensor")
        key = (scale, value.dtype, value.device, value.shape)
        if (
            self._scale is None or self._scale[0] != key
        ):  # one per step's dtype and device, not per microbatch
            self._scale = (key, torch.full(value.shape, scale, dtype=value.dtype, device=value.device))
        self._state = (inp, (value, self._scale[1]))
        return value.detach()

    def take_forward_state(self) -> Any:
        state, self._state = self._state, None
        return state

    def restore_forward_state(self, state: Any) -> None:
        self._state = state

    def backward(self, grad: Any) -> Any:
        """From the output's gradient (None: the output is the loss and its gradient, from ``loss``; a tuple: the
        gradients of the floating-point ones of several outputs, in order); the input's gradient as an array, or
        a tuple of the floating-point inputs' gradients for several inputs (None on the first stage). An input
        the forward did not use gets a gradient of zeros; an input that is not floating point, none (``()``
        for a single one)."""
        import torch

        assert self._state is not None
        inp, out = self._state
        self._state = None
        if grad is None:
            out, grad = out
            _backward(out, grad)
        elif torch.is_tensor(out):
            if type(grad) is not tuple:
                _backward(out, grad if torch.is_tensor(grad) else to_tensor(grad))
            elif grad:
                raise ValueError(f"a stage with one output got {len(grad)} output gradients")
        else:
            floats = [o for o in out if o.is_floating_point()]
            grads = grad if isinstance(grad, (tuple, list)) else (grad,)
            if len(grads) != len(floats):
                raise ValueError(
                    f"a stage whose {len(floats)} floating-point outputs take gradients got {len(grads)}"
                )
            pairs = [(o, g) for o, g in zip(floats, grads, strict=True) if o.requires_grad]
            if pairs:
                torch.autograd.backward(
                    [o for o, _ in pairs], [g if torch.is_tensor(g) else to_tensor(g) for _, g in pairs]
                )
        if self.first:
            return None
        if type(inp) is tuple:
            return tuple(_input_grad(t) for t in inp if t.is_floating_point())
        return _input_grad(inp) if inp.is_floating_point() else ()


def _input_grad(inp: Any) -> Any:
    import torch

    grad = inp.grad if inp.grad is not None else torch.zeros_like(inp)
    return to_array(grad, "an input gradient")


def _describe(out: Any) -> str:
    if isinstance(out, (tuple, list)):
        inner = ", ".join(type(v).__name__ for v in out)
        return f"a {type(out).__name__} of ({inner})"
    return type(out).__name__


def received(kind: str, got: Any, *, train: bool) -> Any:
    """A message for a stage (``kind`` "F": an activation, "B": a gradient) as the tensor its forward or
    backward takes, made by the thread that received it while the stage computed (``Transfers.begin``'s
    ``convert``): a view of the received host array; an activation a leaf that requires its gradient when
    training a floating-point input (what ``TorchStage.forward`` would make of it)."""
    tensor = to_tensor(got)
    if kind == "F" and train and tensor.is_floating_point():
        tensor.requires_grad_(True)
    return tensor


def _backward(out: Any, grad: Any) -> None:
    """``torch.autograd.backward(out, grad)``. A CPU graph's backward runs on this thread, and there the
    autograd engine is called directly, as ``torch.autograd.backward`` calls it after its argument handling
    (for one tensor and its gradient, of the same shape: ~0.1 ms per backward on a path gone cold, a
    pipeline's usual case); elsewhere (the engine's device threads) through ``torch.autograd.backward``."""
    import torch

    engine = getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None)
    if (
        engine is None
        or out.device.type != "cpu"
        or grad.shape != out.shape
        or grad.dtype != out.dtype
        or not out.requires_grad
    ):
        torch.autograd.backward(out, grad)
        return
    engine.run_backward((out,), (grad,), False, False, (), allow_unreachable=True, accumulate_grad=True)


def is_torch_stage(module: Any) -> bool:
    from paramplane.parallel.torch_params import is_torch_module

    return is_torch_module(module) or is_torch_module(getattr(module, "module", None))


def split_kwargs(kwargs: Mapping[str, Any], shared: Mapping[str, Any] | None, m: int) -> list[dict[str, Any]]:
    """Per microbatch: tensors of ``kwargs`` split along dim 0 into ``m`` equal parts (torch's default chunk
    spec), other values and every value of ``shared`` whole."""
    import torch

    out: list[dict[str, Any]] = [dict(shared or {}) for _ in range(m)]
    for name, value in kwargs.items():
        if torch.is_tensor(value) and value.dim() > 0:
            if value.shape[0] % m:
                raise ValueError(
                    f"keyword argument {name!r} has {value.shape[0]} rows, which do not split into {m} equal "
                    "microbatches (pass values every microbatch shares in shared=...)"
                )
            for i, part in enumerate(value.chunk(m)):
                out[i][name] = part
        else:
            for i in range(m):
                out[i][name] = value
    return out


def params_of(stages: Sequence[TorchStage]) -> list[TorchParam]:
    """The stages' trainable parameters as DLPack views (for the pipeline's data-parallel sync); an FSDP
    stage's: its flat shards."""
    seen: set[int] = set()
    out = []
    for stage in stages:
        named = stage.fsdp.named_parameters() if stage.fsdp is not None else stage.module.named_parameters()
        for name, p in named:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(TorchParam(name, p))
    return out


def _grad_pieces(stage: TorchStage) -> list[tuple[str, Any, Any]]:
    """(parameter name, gradient, the parameter's tensor) for each gradient this rank holds of ``stage``: a
    whole ``.grad``, or for an FSDP stage each parameter's piece of its units' sharded gradients."""
    if stage.fsdp is None:
        return [(n, p.grad, p) for n, p in stage.module.named_parameters() if p.grad is not None]
    tensors = dict(stage.module.named_parameters())
    out = []
    for unit in stage.fsdp.units:
        grad = unit.shard.grad
        if grad is None:
            continue
        g = to_tensor(grad)
        for e in unit.shard.layout.entries:
            out.append((e.key, g[e.offset : e.offset + e.size], tensors[e.key]))
    return out


def clip_grad_norm_(stages: Sequence[TorchStage], group: ProcessGroup, max_norm: float) -> Any:
    """Scale the stages' gradients so that the whole model's gradient norm (2-norm) is at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` on the unsplit model; returns that norm (a float64 tensor, the same on
    every rank). Tensor-parallel pieces (parameters with a ``tp_shard``) are summed over their group, an FSDP
    stage's pieces over its shard group, a tied parameter counts once (on its first stage), the pipeline's
    stages are summed over ``group``; gradients already averaged over data-parallel replicas are equal there
    and count once."""
    import torch

    # squares of [tp pieces, whole tensors], each of FSDP shards (summed over the shard group) and of the rest
    squares = {True: torch.zeros(2, dtype=torch.float64), False: torch.zeros(2, dtype=torch.float64)}
    tp_groups: dict[int, ProcessGroup] = {}
    shard_groups: dict[int, ProcessGroup] = {}
    grads = []
    for stage in stages:
        info = getattr(stage.module, STAGE_ATTR, None)
        skip = set()
        if info is not None:
            skip = {name for name, ids in info.tied.values() if min(ids) != info.index}
        if stage.fsdp is not None:
            shard_groups[id(stage.fsdp.shard_group)] = stage.fsdp.shard_group
        for name, g, p in _grad_pieces(stage):
            grads.append(g)
            if name in skip:
                continue
            shard = getattr(p, "tp_shard", None)
            if shard is not None:
                tp_groups[id(shard.group)] = shard.group
            squares[stage.fsdp is not None][0 if shard is not None else 1] += g.detach().double().pow(2).sum()
    if len(tp_groups) > 1 or len(shard_groups) > 1:
        raise ValueError("the stages' tensor-parallel (or FSDP) parameters belong to different groups")
    sharded = squares[True]
    for dp in shard_groups.values():
        dp.all_reduce(to_array(sharded, "a squared gradient norm"), "sum")
    total = (squares[False][:1] + sharded[:1]).clone()
    for tp in tp_groups.values():
        tp.all_reduce(to_array(total, "a squared gradient norm"), "sum")
    total += squares[False][1] + sharded[1]
    group.all_reduce(to_array(total, "a squared gradient norm"), "sum")
    norm = total.sqrt()[0]
    clip_grads_to(grads, norm, max_norm)
    return norm
