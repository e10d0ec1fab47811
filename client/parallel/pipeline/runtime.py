"""``Pipeline``: runs a schedule's actions on this rank's stage modules, moving activations with send/recv.

Usage::

    pipe = pp.Pipeline(stage_module, mesh.group("pp"), schedule="1f1b", microbatches=8,
                       loss_fn=pp.nn.CrossEntropyLoss())
    losses = pipe.step(x, target=y)   # x on the first stage, y on the last; per-microbatch losses there
    opt.step()                        # gradients were accumulated in the stage modules

The batch is split along axis 0 into equal microbatches. Activations and gradients cross stages on
the pp group's send/recv lane; the first microbatch of each step on each edge is received in the
dtype and shape its frame header carries and the others must match it, so shapes may change between
steps and a disagreement within one is a CollectiveMismatch, not a hang.
With ``dp_group`` the stage gradients are averaged over data-parallel replicas once, after the
last microbatch (``mesh.group("dp")``; each replica steps on its share of the batch).
With ``scale_grads`` (default) each microbatch's loss gradient is divided by the number of
microbatches: a ``"mean"`` loss then gives the gradient of the mean loss over the whole batch.
For a ``"sum"`` loss pass ``scale_grads=False`` to get the gradient of the sum over the batch.
Interleaved 1F1B takes ``microbatch_group`` (default p): microbatches pass through each chunk in groups
of that many; larger groups hide each transfer behind more compute and keep more activations alive.
``poll_us`` > 0 keeps the transfer threads awake during a step (they wait in slices of that many
microseconds): their code stays warm, so dependent transfers get faster, for some CPU time per step
(README: Pipeline bubble).
torch stage modules (``torch.nn.Module``, e.g. from ``pp.pipeline_split``; a list of chunks for interleaved
1F1B) run with autograd inside each stage (``torch_stage.py``)::

    pipe = pp.Pipeline(stage, mesh.group("pp"), "1f1b", 8, loss_fn=pp.causal_lm_loss)
    losses = pipe.step(ids, target=labels, attention_mask=mask)   # every rank passes the kwargs
    opt.step()                                                     # .grad accumulated over microbatches

Activations and their gradients cross stages as tensors viewed through DLPack (no copy on CPU); keyword
arguments reach every stage (tensors split into the microbatches, ``shared=`` values whole); the last stage's
``loss_fn(output, target)`` is a torch scalar; gradients match torch's schedules with ``scale_grads=True``.
Parameters tied across stages by ``pipeline_split`` get their gradients summed over the stages after the step,
in one order on every holder, so that the copies stay bit-identical at any dp size (``tied.py``).
A ``pp.DDP``-wrapped stage runs without a sync per backward and has its gradients averaged over its group
once per step (as ``dp_group`` does). A ``pp.FSDP``-wrapped stage (every chunk of the rank wrapped, over the
dp group) likewise accumulates whole gradients over the microbatches under ``no_sync`` and reduce-scatters
them once, after the last backward (``FSDP.reduce_accumulated_gradients``); the optimizer steps
``fsdp.parameters()``, its shards.
The training thread only computes: transfers run on threads of their own (``transfers.py``), which
receive each neighbour's messages in the order it sends them and file them by name. Sends never wait
for the receiver (what the socket does not take, the sender's event loop finishes in order), so a
schedule that ``validate`` accepts cannot deadlock, whatever the size of the activations.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from paramplane.group import ProcessGroup
from paramplane.nn.loss import Loss
from paramplane.nn.module import Array, Module
from paramplane.node.arrays import array_module
from paramplane.node.errors import PlaneError
from paramplane.parallel.pipeline import schedules
from paramplane.parallel.pipeline.plan import Op, agree, compile_ops, incoming
from paramplane.parallel.pipeline.plan import nbytes as state_nbytes
from paramplane.parallel.pipeline.tied import TiedWeights
from paramplane.parallel.pipeline.torch_stage import (
    STAGE_ATTR,
    TorchStage,
    clip_grad_norm_,
    is_torch_stage,
    params_of,
    received,
    split_kwargs,
)
from paramplane.parallel.pipeline.transfers import Transfers

MAX_POLL_US = 100_000


class Pipeline:
    """This rank's part of a pipeline over ``group`` (see the module docstring).

    ``stage_modules``: this rank's stage, or its v chunks for ``interleaved_1f1b`` (stage ``s`` on rank
    ``s % p``); ``schedule``: ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"``; ``loss_fn`` on the last
    stage; ``scale_grads`` divides each microbatch's loss gradient by ``microbatches`` (right for a mean loss);
    ``dp_group`` averages the stage gradients over data-parallel replicas after the step;
    ``microbatch_group`` (interleaved 1F1B only, default p) is how many microbatches pass through a chunk
    before the next chunk; ``poll_us`` (default 0: sleep until woken) makes the transfer threads wait in slices
    of that many microseconds while a step runs.
    """

    def __init__(
        self,
        stage_modules: Any,
        group: ProcessGroup,
        schedule: str = "1f1b",
        microbatches: int = 8,
        loss_fn: Loss | Any = None,
        scale_grads: bool = True,
        dp_group: ProcessGroup | None = None,
        microbatch_group: int | None = None,
        poll_us: int = 0,
    ) -> None:
        if isinstance(poll_us, bool) or not isinstance(poll_us, int) or not 0 <= poll_us <= MAX_POLL_US:
            raise ValueError(f"poll_us must be an int in [0, {MAX_POLL_US}] (0: no polling), got {poll_us!r}")
        single = isinstance(stage_modules, Module) or is_torch_stage(stage_modules)
        modules: list[Any] = [stage_modules] if single else list(stage_modules)
        if not isinstance(group, ProcessGroup):
            raise ValueError(f"Pipeline needs a ProcessGroup, got {type(group).__name__}")
        self._ddps: list[Any] = []
        self._fsdps: list[Any] = []
        self._torch = bool(modules) and all(is_torch_stage(m) for m in modules)
        if self._torch:
            modules, dp_group = self._torch_stages(modules, group, dp_group)
        elif not modules or not all(isinstance(m, Module) for m in modules):
            raise ValueError(
                "stage_modules must be a paramplane.nn Module or a torch.nn.Module, or a non-empty list of them "
                "(one per chunk, all of one kind)"
            )
        agree(group, schedule, microbatches, len(modules), microbatch_group)
        self._tied = TiedWeights(modules, group) if self._torch else None
        self.modules: list[Any] = modules
        self.group = group
        self.schedule = schedule
        self.num_microbatches = microbatches
        self.loss_fn = loss_fn
        self.scale_grads = scale_grads
        self.dp_group = dp_group
        self.num_stages = group.size * len(modules)
        self._all = [
            schedules.build(schedule, r, group.size, microbatches, len(modules), microbatch_group)
            for r in range(group.size)
        ]
        self.actions = self._all[group.rank]
        schedules.validate(self._all, microbatches, len(modules))
        forward_only = [
            schedules.forward_only(r, group.size, microbatches, len(modules)) for r in range(group.size)
        ]
        self._plan = compile_ops(self.actions, modules, group.rank, group.size)
        self._plan_forward_only = compile_ops(forward_only[group.rank], modules, group.rank, group.size)
        self._incoming = incoming(self._all, group.rank)
        self._incoming_forward_only = incoming(forward_only, group.rank)
        self._peak_sets = 0
        self._peak_bytes = 0
        self._transfers = Transfers(group, poll_us / 1e6)
        self._broken: BaseException | None = None
        tracer = group.tracer
        self._tracer = tracer if hasattr(tracer, "mark") else None

    def _torch_stages(
        self, modules: list[Any], group: ProcessGroup, dp_group: ProcessGroup | None
    ) -> tuple[list[TorchStage], ProcessGroup | None]:
        """torch stage modules as ``TorchStage``s (a ``pp.DDP``-wrapped stage: its group becomes the data-parallel
        group, its gradients averaged once per step); checks ``pipeline_split``'s stage indices."""
        from paramplane.parallel.ddp import DDP
        from paramplane.parallel.fsdp import FSDP, TorchFSDP
        from paramplane.parallel.torch_params import is_torch_module

        p, v = group.size, len(modules)
        stages = []
        for chunk, m in enumerate(modules):
            stage_id = chunk * p + group.rank
            fsdp = None
            if isinstance(m, (DDP, TorchFSDP)):
                if dp_group is not None and dp_group is not m.group:
                    raise ValueError(
                        f"a pp.{'DDP' if isinstance(m, DDP) else 'FSDP'}-wrapped stage reduces over its own group: "
                        "leave out dp_group"
                    )
                if group.size > 1 and m.group.ranks == group.ranks:
                    raise ValueError(
                        "the stage's data-parallel wrapper is over the pipeline's own group: wrap it over the dp "
                        "group (mesh.group('dp'))"
                    )
                dp_group = m.group
                (self._ddps if isinstance(m, DDP) else self._fsdps).append(m)
                inner, call = m.module, m
                fsdp = m if isinstance(m, TorchFSDP) else None
            elif isinstance(m, FSDP) or not is_torch_module(m):
                raise ValueError(
                    f"Pipeline takes torch stage modules or pp.DDP- or pp.FSDP-wrapped ones, not "
                    f"{type(m).__name__}: average the stages over data-parallel replicas with "
                    "dp_group=mesh.group('dp')"
                )
            else:
                inner, call = m, m
            for name, t in inner.named_parameters():
                if getattr(getattr(t, "tp_shard", None), "experts", False):
                    raise ValueError(
                        f"pp.Pipeline does not run expert-parallel stages ({name!r} is split by ExpertParallel): "
                        "train such a model with pp.DDP over the expert-parallel group"
                    )
            info = getattr(inner, STAGE_ATTR, None)
            if info is not None and (info.index != stage_id or info.num_stages != p * v):
                raise ValueError(
                    f"group rank {group.rank} chunk {chunk} runs stage {stage_id} of {p * v}, but was given stage "
                    f"{info.index} of {info.num_stages} from pipeline_split (rank r takes stages r, r + p, ...)"
                )
            stages.append(TorchStage(inner, call, first=stage_id == 0, fsdp=fsdp))
        if self._fsdps and len(self._fsdps) != len(stages):
            raise ValueError("wrap every chunk of this rank in pp.FSDP, or none")
        return stages, dp_group

    # -- inspection ---------------------------------------------------------------------------------
    @property
    def is_first(self) -> bool:
        return self.group.rank == 0

    @property
    def is_last(self) -> bool:
        return self.group.rank == (self.num_stages - 1) % self.group.size

    def schedule_table(self) -> str:
        """Every rank's compute order (the schedule as data)."""
        return schedules.table(self._all)

    def parameters(self) -> list[Any]:
        """The stages' parameters (for torch stages, ``TorchParam`` views of the tensors)."""
        if self._torch:
            return list(params_of(self.modules))
        return [p for m in self.modules for p in m.parameters()]

    def memory_stats(self) -> dict[str, Any]:
        """Measured peak of live activation sets (and their bytes, each stage's states sized once per step:
        its microbatches share a shape) in the last step, beside the formulas."""
        p, m = self.group.size, self.num_microbatches
        return {
            "peak_activation_sets": self._peak_sets,
            "peak_activation_bytes": self._peak_bytes,
            "gpipe_peak_activations": schedules.gpipe_peak_activations(p, m),
            "one_f_one_b_peak_activations": schedules.one_f_one_b_peak_activations(p, m, self.group.rank),
        }

    # -- running ------------------------------------------------------------------------------------
    def _split(self, x: Array | None, what: str) -> list[Array] | None:
        if x is None:
            return None
        if type(x) is tuple and self._torch and what == "x":  # the first stage's positional arguments
            parts = [self._split(v, f"{what}[{i}]") for i, v in enumerate(x)]
            return [tuple(mb) for mb in zip(*parts, strict=True)]
        m = self.num_microbatches
        if x.shape[0] % m:
            raise ValueError(f"{what} has {x.shape[0]} rows, which do not split into {m} equal microbatches")
        return [x[i * (x.shape[0] // m) : (i + 1) * (x.shape[0] // m)] for i in range(m)]

    def _like(self, x: Array | None, target: Array | None) -> Any:
        """An array on the device this rank's stages compute on (messages are taken there): a parameter's,
        else the batch's or the target's (a stage without parameters), else the host."""
        for p in self.parameters():
            return p.data
        if type(x) is tuple:
            x = x[0] if x else None
        return x if x is not None else (target if target is not None else np.empty(0))

    def step(
        self,
        x: Array | None = None,
        target: Array | None = None,
        *,
        shared: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[float] | None:
        """One training step over the batch; per-microbatch losses on the last stage, None elsewhere.

        torch stages only: ``x`` may be a tuple of tensors (the first stage's positional arguments, each split
        along dim 0); ``kwargs`` reach every stage's forward, each tensor split along dim 0 into the
        microbatches (an attention mask: pass it on every rank), and ``shared`` values reach every microbatch
        whole."""
        if self.is_first and x is None:
            raise ValueError("the first pipeline stage needs the batch: step(x, ...)")
        if self.is_last and (target is None or self.loss_fn is None):
            raise ValueError("the last pipeline stage needs step(..., target=...) and a loss_fn")
        inputs, targets = self._split(x, "x"), self._split(target, "target")
        self._set_kwargs(kwargs, shared, train=True)
        like = self._like(x, target)
        losses: dict[int, Any] = {}  # torch stages: detached loss tensors, read after the step
        with contextlib.ExitStack() as stack:
            for wrapper in self._ddps + self._fsdps:  # no sync per backward: the gradients are reduced once
                stack.enter_context(wrapper.no_sync())
            self._run(self._plan, inputs, targets, like, losses, train=True)
        held = self._tied.hold() if self._tied is not None else []  # reduced on their own (tied.py)
        for fsdp in self._fsdps:
            fsdp.reduce_accumulated_gradients()
        if not self._fsdps and self.dp_group is not None and self.dp_group.size > 1:
            self._sync_data_parallel(self.dp_group)
        if self._tied is not None:
            self._tied.reduce(held, self.dp_group)
        return [float(losses[i]) for i in range(self.num_microbatches)] if self.is_last else None

    def optim_state(self, optimizer: Any, *, state_arrays: tuple[str, ...] | None = None) -> Any:
        """torch stages: ``optimizer``'s state over this rank's stages as checkpoint state under the dense
        model's keys, which loads at another split or pipeline size (``pp.pipeline_optim_state``)."""
        from paramplane.parallel.pipeline.optim_state import pipeline_optim_state

        if not self._torch:
            raise ValueError(
                "optim_state is for torch stages: a paramplane.optim optimizer is checkpointable itself"
            )
        return pipeline_optim_state([s.call for s in self.modules], optimizer, state_arrays=state_arrays)

    def clip_grad_norm_(self, max_norm: float) -> Any:
        """torch stages: clip the gradients to a global 2-norm of ``max_norm`` over the whole model (every
        stage, tensor-parallel pieces, a tied weight once), as ``torch.nn.utils.clip_grad_norm_`` on the unsplit
        model; returns the norm (a tensor, equal on every rank). Call it on every rank, after ``step``."""
        if not self._torch:
            raise ValueError("Pipeline.clip_grad_norm_ is for torch stage modules")
        if not max_norm > 0:
            raise ValueError(f"max_norm must be positive, got {max_norm!r}")
        return clip_grad_norm_(self.modules, self.group, float(max_norm))

    def _set_kwargs(
        self, kwargs: Mapping[str, Any], shared: Mapping[str, Any] | None, *, train: bool
    ) -> None:
        if not self._torch:
            if kwargs or shared:
                raise ValueError(
                    "keyword arguments reach torch stage modules only; paramplane.nn stages take x"
                )
            return
        per_mb = split_kwargs(kwargs, shared, self.num_microbatches) if kwargs or shared else []
        for stage in self.modules:
            stage.kwargs, stage.train = per_mb, train

    def _run(
        self,
        plan: Sequence[Op],
        inputs: list[Array] | None,
        targets: list[Array] | None,
        like: Any,
        losses: dict[int, Any],
        *,
        train: bool,
    ) -> dict[int, Array]:
        """Run ``plan`` on this rank: the last stage's outputs by microbatch when it has no ``targets``, else
        its losses in ``losses``; ``train`` keeps each forward's state for its backward. Any failure leaves
        the pipeline broken: its neighbours' messages are out of step with it from then on.

        Each result that another rank needs is handed to the sender right after its compute (the neighbour
        may be waiting for it), before this rank's own bookkeeping."""
        if isinstance(self._broken, PlaneError):
            raise self._broken  # the group failed with it, and stays failed
        if self._broken is not None:
            raise RuntimeError(
                f"an earlier step of this pipeline failed ({self._broken!r}); its stages' messages are out of "
                "step now: fix the cause and build a new Pipeline on a new group"
            ) from self._broken
        transfers = self._transfers
        convert = functools.partial(received, train=train) if self._torch else None
        transfers.begin(self._incoming if train else self._incoming_forward_only, like, convert)
        track = train  # the peaks describe the last training step (eval_step keeps no states)
        # Values between stages of this rank, and loss gradients; forward states with their bytes.
        local: dict[tuple[str, int, int], Array] = {}
        states: dict[tuple[int, int], tuple[Any, int]] = {}
        state_bytes: dict[int, int] = {}  # per stage: its microbatches share a shape, so their states a size
        finals: dict[int, Array] = {}
        last, tracer, torch_stages = self.num_stages - 1, self._tracer, self._torch
        scale = 1.0 / self.num_microbatches if self.scale_grads else 1.0
        if track:
            self._peak_sets = self._peak_bytes = 0
        live_bytes = 0
        try:
            for op in plan:
                stage, mb = op.stage, op.microbatch
                if op.forward:
                    if op.incoming is not None:
                        inp = transfers.take(op.incoming)
                    else:
                        inp = inputs[mb] if stage == 0 and inputs is not None else local.pop(("F", stage, mb))
                    start = time.monotonic()
                    out = op.module.forward(inp, mb) if torch_stages else op.module.forward(inp)
                    end = time.monotonic()  # handing a result to the sender is not compute; the loss is
                    if op.dst is not None:
                        sent = op.module.outgoing(out, op.name) if torch_stages else out
                        transfers.send(sent, op.dst, "F", stage)
                    elif stage < last:
                        local[("F", stage + 1, mb)] = out
                    elif targets is not None:
                        assert self.loss_fn is not None
                        if torch_stages:
                            losses[mb] = op.module.loss(self.loss_fn, targets[mb], scale)
                            local[("B", stage, mb)] = None  # the backward starts from the loss
                        else:
                            losses[mb] = float(self.loss_fn.forward(out, targets[mb]))
                            local[("B", stage, mb)] = self.loss_fn.backward(grad_scale=scale)
                        end = time.monotonic()
                    else:
                        finals[mb] = out
                    state = op.module.take_forward_state()
                    if train:
                        nbytes = state_bytes.get(stage)
                        if nbytes is None:
                            nbytes = state_bytes[stage] = state_nbytes(state)
                        states[(stage, mb)] = (state, nbytes)
                        live_bytes += nbytes
                        if len(states) > self._peak_sets:
                            self._peak_sets = len(states)
                        if live_bytes > self._peak_bytes:
                            self._peak_bytes = live_bytes
                else:
                    grad = (
                        transfers.take(op.incoming)
                        if op.incoming is not None
                        else local.pop(("B", stage, mb))
                    )
                    state, nbytes = states.pop((stage, mb))
                    live_bytes -= nbytes
                    start = time.monotonic()
                    op.module.restore_forward_state(state)
                    grad_in = op.module.backward(grad)
                    end = time.monotonic()
                    if op.dst is not None:
                        transfers.send(grad_in, op.dst, "B", stage)
                    elif stage > 0:
                        local[("B", stage - 1, mb)] = grad_in
                if tracer is not None:
                    tracer.mark(op.name, start, end, stage=stage, mb=mb)
            transfers.finish()
        except BaseException as exc:
            self._broken = exc
            if not isinstance(exc, PlaneError):  # this stage's own error: its neighbours would wait it out
                self.group.abort_point_to_point(
                    f"the pipeline stage on group rank {self.group.rank} failed: {type(exc).__name__}: {exc}"
                )
            transfers.abandon()
            # The exception's traceback keeps this frame: not the step's activations with it.
            local.clear()
            states.clear()
            finals.clear()
            raise
        assert not local and not states, "schedule left work undone"
        return finals

    def _sync_data_parallel(self, dp: ProcessGroup) -> None:
        """Average the stage modules' gradients over ``dp``: one all-reduce of one flat buffer per dtype."""
        params = [p for p in self.parameters() if p.grad is not None]
        for dtype in sorted({p.grad.dtype.str for p in params if p.grad is not None}):
            mine = [p for p in params if p.grad is not None and p.grad.dtype.str == dtype]
            xp = array_module(mine[0].grad)
            flat = xp.concatenate([p.grad.reshape(-1) for p in mine if p.grad is not None])
            dp.all_reduce(flat, "mean")
            start = 0
            for p in mine:
                assert p.grad is not None
                p.grad[...] = flat[start : start + p.grad.size].reshape(p.grad.shape)
                start += p.grad.size

    def eval_step(
        self, x: Array | None = None, *, shared: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> Array | None:
        """Forward only, microbatch by microbatch; the concatenated outputs on the last stage."""
        if self.is_first and x is None:
            raise ValueError("the first pipeline stage needs the batch: eval_step(x)")
        self._set_kwargs(kwargs, shared, train=False)
        like = self._like(x, None)
        finals = self._run(self._plan_forward_only, self._split(x, "x"), None, like, {}, train=False)
        outs = [finals[i] for i in sorted(finals)]
        if self._torch and outs:
            import torch

            if isinstance(outs[0], (tuple, list)):  # a last stage with several outputs: each concatenated
                return tuple(torch.cat(parts) for parts in zip(*outs, strict=True))
            return torch.cat(outs)
        return array_module(outs[0]).concatenate(outs) if outs else None
