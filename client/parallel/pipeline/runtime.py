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
Sends never wait for the receiver (what the socket does not take, the sender's event loop finishes
in order) and a receive reads its frame when the stage needs it, so a schedule that ``validate``
accepts cannot deadlock, whatever the size of the activations.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from paramplane.group import ProcessGroup
from paramplane.nn.loss import Loss
from paramplane.nn.module import Array, Module, Parameter
from paramplane.node.arrays import array_module
from paramplane.node.errors import CollectiveMismatch
from paramplane.parallel.pipeline import schedules
from paramplane.work import Work


class Pipeline:
    """This rank's part of a pipeline over ``group`` (see the module docstring)."""

    def __init__(
        self,
        stage_modules: Module | Sequence[Module],
        group: ProcessGroup,
        schedule: str = "1f1b",
        microbatches: int = 8,
        loss_fn: Loss | None = None,
        scale_grads: bool = True,
        dp_group: ProcessGroup | None = None,
    ) -> None:
        modules = [stage_modules] if isinstance(stage_modules, Module) else list(stage_modules)
        if not modules or not all(isinstance(m, Module) for m in modules):
            raise ValueError("stage_modules must be a Module or a non-empty list of Modules (one per chunk)")
        if not isinstance(group, ProcessGroup):
            raise ValueError(f"Pipeline needs a ProcessGroup, got {type(group).__name__}")
        schedules.check(schedule, group.size, microbatches, len(modules))
        counts = group.all_gather(np.array([len(modules)], np.int64)).tolist()
        if len(set(counts)) != 1:
            raise CollectiveMismatch(
                f"pipeline ranks hold different numbers of stage modules {counts} (group '{group.name}'); "
                "every rank must pass the same number (v chunks for interleaved_1f1b, else one)"
            )
        self.modules = modules
        self.group = group
        self.schedule = schedule
        self.num_microbatches = microbatches
        self.loss_fn = loss_fn
        self.scale_grads = scale_grads
        self.dp_group = dp_group
        self.num_stages = group.size * len(modules)
        self.actions = schedules.build(schedule, group.rank, group.size, microbatches, len(modules))
        self._all = [
            schedules.build(schedule, r, group.size, microbatches, len(modules)) for r in range(group.size)
        ]
        schedules.validate(self._all, microbatches, len(modules))
        self._peak_sets = 0
        self._peak_bytes = 0
        self._shapes: dict[tuple[str, int], tuple[Any, tuple[int, ...]]] = {}
        self._sends: list[Work[Any]] = []
        tracer = group.tracer
        self._tracer = tracer if hasattr(tracer, "mark") else None

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

    def parameters(self) -> list[Parameter]:
        return [p for m in self.modules for p in m.parameters()]

    def memory_stats(self) -> dict[str, Any]:
        """Measured peak of live activation sets (and their bytes) in the last step, beside the formulas."""
        p, m = self.group.size, self.num_microbatches
        return {
            "peak_activation_sets": self._peak_sets,
            "peak_activation_bytes": self._peak_bytes,
            "gpipe_peak_activations": schedules.gpipe_peak_activations(p, m),
            "one_f_one_b_peak_activations": schedules.one_f_one_b_peak_activations(p, m, self.group.rank),
        }

    # -- transfers ----------------------------------------------------------------------------------
    def _send(self, x: Array, stage: int) -> None:
        """Send to ``stage`` without waiting (the next compute does not wait for the wire); ``_finish_sends``
        waits for them at the end of the step. The arrays sent are not touched again, so they need no copy."""
        x = array_module(x).ascontiguousarray(x)
        self._sends.append(self.group.send(x, stage % self.group.size, async_op=True))

    def _finish_sends(self) -> None:
        sends, self._sends = self._sends, []
        for work in sends:
            work.wait()

    def _recv(self, stage: int, microbatch: int, kind: str, like: Any) -> Array:
        """Receive from ``stage``. Microbatch 0 of a step takes the dtype and shape its frame header carries;
        later ones are received into arrays like it, so a sender whose array differs fails with
        CollectiveMismatch (the frame header names both) instead of feeding the stage a wrong shape.
        Messages that came while this rank computed wait in the data plane's inbox, so a receive issued
        only now costs no latency."""
        src = stage % self.group.size
        if microbatch == 0:
            got: Array = self.group.recv_array(src, like=like)
            self._shapes[(kind, stage)] = (got.dtype, tuple(got.shape))
            return got
        dtype, shape = self._shapes[(kind, stage)]
        out: Array = self.group.recv(array_module(like).empty(shape, dtype), src)
        return out

    # -- running ------------------------------------------------------------------------------------
    def _split(self, x: Array | None, what: str) -> list[Array] | None:
        if x is None:
            return None
        m = self.num_microbatches
        if x.shape[0] % m:
            raise ValueError(f"{what} has {x.shape[0]} rows, which do not split into {m} equal microbatches")
        return [x[i * (x.shape[0] // m) : (i + 1) * (x.shape[0] // m)] for i in range(m)]

    def step(self, x: Array | None = None, target: Array | None = None) -> list[float] | None:
        """One training step over the batch; per-microbatch losses on the last stage, None elsewhere."""
        if self.is_first and x is None:
            raise ValueError("the first pipeline stage needs the batch: step(x, ...)")
        if self.is_last and (target is None or self.loss_fn is None):
            raise ValueError("the last pipeline stage needs step(..., target=...) and a loss_fn")
        inputs, targets = self._split(x, "x"), self._split(target, "target")
        like = x if x is not None else (target if target is not None else np.empty(0))
        received: dict[tuple[str, int, int], Array] = {}
        outputs: dict[tuple[int, int], Array] = {}
        states: dict[tuple[int, int], Any] = {}
        grads: dict[tuple[int, int], Array] = {}
        losses: dict[int, float] = {}
        self._peak_sets = self._peak_bytes = 0
        self._sends = []  # a step that raised left its sends behind; the group has failed anyway
        p = self.group.size
        for a in self.actions:
            key = (a.stage, a.microbatch)
            module = self.modules[a.stage // p]
            if a.kind in ("RECV_F", "RECV_B"):
                kind = a.kind[-1]
                received[(kind, *key)] = self._recv(_source(a), a.microbatch, kind, like)
            elif a.kind == "F":
                start = time.monotonic()
                inp = (
                    inputs[a.microbatch] if a.stage == 0 and inputs is not None else received.pop(("F", *key))
                )
                out = module.forward(inp)
                if a.stage == self.num_stages - 1:
                    assert self.loss_fn is not None and targets is not None
                    losses[a.microbatch] = float(self.loss_fn.forward(out, targets[a.microbatch]))
                    scale = 1.0 / self.num_microbatches if self.scale_grads else 1.0
                    grads[key] = self.loss_fn.backward(grad_scale=scale)
                else:
                    outputs[key] = out
                states[key] = module.take_forward_state()
                self._mark(a, start)
                self._note(states)
            elif a.kind == "SEND_F":
                self._send(outputs.pop(key), a.stage + 1)
            elif a.kind == "B":
                start = time.monotonic()
                grad = grads.pop(key) if key in grads else received.pop(("B", *key))
                module.restore_forward_state(states.pop(key))
                grad_in = module.backward(grad)
                if a.stage > 0:
                    grads[key] = grad_in
                self._mark(a, start)
            else:  # SEND_B
                self._send(grads.pop(key), a.stage - 1)
        self._finish_sends()
        assert not states and not received, "schedule left work undone"
        if self.dp_group is not None and self.dp_group.size > 1:
            self._sync_data_parallel(self.dp_group)
        return [losses[i] for i in range(self.num_microbatches)] if self.is_last else None

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

    def eval_step(self, x: Array | None = None) -> Array | None:
        """Forward only, microbatch by microbatch; the concatenated outputs on the last stage."""
        if self.is_first and x is None:
            raise ValueError("the first pipeline stage needs the batch: eval_step(x)")
        inputs = self._split(x, "x")
        like = x if x is not None else np.empty(0)
        p, last = self.group.size, self.num_stages - 1
        outs: list[Array] = []
        self._sends = []
        for mb in range(self.num_microbatches):
            for stage in range(self.group.rank, self.num_stages, p):
                if stage == 0 and inputs is not None:
                    inp = inputs[mb]
                else:
                    inp = self._recv(stage - 1, mb, "F", like)
                out = self.modules[stage // p].forward(inp)
                self.modules[stage // p].take_forward_state()  # no backward follows
                if stage == last:
                    outs.append(out)
                else:
                    self._send(out, stage + 1)
        self._finish_sends()
        return array_module(outs[0]).concatenate(outs) if outs else None

    def _mark(self, action: schedules.Action, start: float) -> None:
        """A traced compute span (``PARAMPLANE_TRACE``) per forward or backward: the schedule's timeline."""
        if self._tracer is not None:
            self._tracer.mark(f"{action}", start, time.monotonic(), stage=action.stage, mb=action.microbatch)

    def _note(self, states: dict[tuple[int, int], Any]) -> None:
        self._peak_sets = max(self._peak_sets, len(states))
        self._peak_bytes = max(self._peak_bytes, sum(_nbytes(s) for s in states.values()))


def _source(action: schedules.Action) -> int:
    """The stage a receive's message comes from."""
    return action.stage - 1 if action.kind == "RECV_F" else action.stage + 1


def _nbytes(obj: Any) -> int:
    if hasattr(obj, "nbytes") and hasattr(obj, "shape"):
        return int(obj.nbytes)
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0
