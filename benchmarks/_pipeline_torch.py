"""The torch side of ``pipeline.py``: torch stage modules under ``pp.Pipeline`` and under the peer,
``torch.distributed.pipelining`` (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B`` at their
defaults) over gloo. Both run the same stand-in stage: a ``torch.nn.Module`` whose forward and backward are an
autograd function that waits a known time and records how long it ran, so each one's bubble is measured the
same way (idle = step time - the sum of those spans, per step the rank with the largest idle fraction).

Busy is counted three ways, each the same under both runtimes: the waits alone; the module's own code (its
forward, its backward function: ``module_spans``); and the stage's torch work (``work_spans``): the module's
forward, the ``loss_fn`` call on the last stage and each call of torch's autograd engine for a stage's backward
(``torch.autograd.backward`` / ``grad`` under the peer, ``torch_stage._backward`` under ``pp.Pipeline``), which
computes the module's gradients and costs 0.1 ms (warm) to 0.45 ms (after a sleep) per call on this 2-core host
beyond the backward function itself: the module's compute, which the module spans count as idle."""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

P = 2
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
}
Configs = list[tuple[str, int, Any, bool, int]]
Measured = Callable[..., dict[str, Any]]


@dataclass
class Spans:
    """What one step's compute recorded, each list one span (seconds) per call: ``waits`` the stand-in's waits,
    ``module`` its own code, ``work`` the stage's torch work (see the module docstring)."""

    waits: list[float] = field(default_factory=list)
    module: list[float] = field(default_factory=list)
    work: list[float] = field(default_factory=list)

    def clear(self) -> None:
        self.waits.clear()
        self.module.clear()
        self.work.clear()


def wait_stage(seconds: float, spans: Spans) -> Any:
    """A torch module that waits ``seconds`` in its forward and in its backward, appending each wait's
    measured length to ``spans.waits``; it has a parameter (so a first stage runs its backward too). Also the
    length of each call of the module's own code to ``spans.module``: its ``forward`` from entry to return, and
    its backward function from entry to return (the autograd engine's nodes after that function are left out);
    its forward's to ``spans.work`` too (its backward there is the engine's call: ``timed_work``)."""
    import torch

    class WaitFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, seconds: float) -> Any:
            start = time.monotonic()
            time.sleep(seconds)
            ctx.seconds = seconds
            spans.waits.append(time.monotonic() - start)
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            start = time.monotonic()
            time.sleep(ctx.seconds)
            spans.waits.append(time.monotonic() - start)
            out = grad.clone()
            spans.module.append(time.monotonic() - start)
            return out, None

    class Wait(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def forward(self, x: Any) -> Any:
            start = time.monotonic()
            out = WaitFn.apply(x + self.w * 0, seconds)
            span = time.monotonic() - start
            spans.module.append(span)
            spans.work.append(span)
            return out

    return Wait()


def _timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.monotonic() - start)

    return call


@contextlib.contextmanager
def timed_work(spans: Spans, ours: bool) -> Iterator[None]:
    """Inside: each call of torch's autograd engine for a stage's backward appends its span to ``spans.work``:
    ``pp.Pipeline``'s (``torch_stage._backward``) when ``ours``, else ``torch.autograd.backward`` and
    ``torch.autograd.grad`` (what ``torch.distributed.pipelining`` calls)."""
    import torch

    if ours:
        from paramplane.parallel.pipeline import torch_stage

        targets: list[tuple[Any, str]] = [(torch_stage, "_backward")]
    else:
        targets = [(torch.autograd, "backward"), (torch.autograd, "grad")]
    saved = [(obj, name, getattr(obj, name)) for obj, name in targets]
    for obj, name, fn in saved:
        setattr(obj, name, _timed(fn, spans.work))
    try:
        yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)


def _run_steps(
    step: Callable[[], None], barrier: Callable[[], None], spans: Spans, n: int, expected: int, work: int
) -> tuple[list[float], list[float], list[float], list[float], list[float]]:
    """``n`` + 1 timed steps (the first, a warm-up, is left out by the caller): step times, CPU times, busy
    (the waits), busy (the stage module's own code), busy (the stage's torch work: ``work`` spans a step)."""
    times, busy, cpu, module_busy, work_busy = [], [], [], [], []
    for _ in range(n + 1):
        barrier()
        spans.clear()
        t, c = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        # (torch's first step also runs each stage's forward once to learn the shapes: not measured)
        counts = (len(spans.waits), len(spans.module), len(spans.work))
        assert counts == (expected, expected, work) or len(times) == 1, (
            f"expected {expected} compute spans and {work} work spans, got {counts}"
        )
        busy.append(sum(spans.waits))
        module_busy.append(sum(spans.module))
        work_busy.append(sum(spans.work))
    return times, cpu, busy, module_busy, work_busy


def worker_torch(
    args: argparse.Namespace, configs: Configs, stage_ms: Callable[..., float], measured: Measured
) -> list[dict[str, Any]]:
    """The peer on this rank: every configuration without a microbatch group (torch has no such setting)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    rank = int(os.environ["PARAMPLANE_RANK"])
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=P)
    spans = Spans()
    loss_fn = _timed(torch.nn.functional.mse_loss, spans.work)
    rows = []
    for schedule, v, group, split, m in configs:
        if group is not None:
            continue
        stage_s = stage_ms(args, v, split) / 1000
        stages = [
            pipelining.PipelineStage(wait_stage(stage_s, spans), rank + c * P, P * v, torch.device("cpu"))
            for c in range(v)
        ]
        pipe = getattr(pipelining, TORCH_SCHEDULES[schedule])(
            stages if v > 1 else stages[0], m, loss_fn=loss_fn
        )
        x = torch.zeros(m, 8)

        def step(pipe: Any = pipe, x: Any = x) -> None:
            pipe.step(x) if rank == 0 else pipe.step(target=x)

        last = rank == P - 1
        with timed_work(spans, ours=False):
            times, cpu, busy, module_busy, work_busy = _run_steps(
                step, dist.barrier, spans, args.steps, 2 * m * v, 2 * m * v + (m if last else 0)
            )
        rows.append(
            measured(
                schedule,
                m,
                v,
                times,
                cpu,
                split,
                busy_s=busy[1:],
                module_busy_s=module_busy[1:],
                work_busy_s=work_busy[1:],
                torch_version=torch.__version__,
            )
        )
    dist.barrier()
    dist.destroy_process_group()
    return rows


def worker_torch_stages(
    args: argparse.Namespace, configs: Configs, stage_ms: Callable[..., float], measured: Measured
) -> list[dict[str, Any]]:
    """The same torch stand-in stages under ``pp.Pipeline`` (its defaults), the peer's configurations and, for
    interleaved 1F1B, the larger microbatch group too (a setting torch does not have: its rows say so)."""
    import torch

    import paramplane as pp

    spans = Spans()
    loss_fn = _timed(torch.nn.functional.mse_loss, spans.work)
    rows = []
    with pp.init() as world:
        g = world.group
        for schedule, v, group, split, m in configs:
            stage_s = stage_ms(args, v, split) / 1000
            chunks = [wait_stage(stage_s, spans) for _ in range(v)]
            pipe = pp.Pipeline(
                chunks if v > 1 else chunks[0], g, schedule, m, loss_fn=loss_fn, microbatch_group=group
            )
            x = torch.zeros(m, 8)

            actions: list[dict[str, float]] = []  # per step: each action's stage span (for the replay)

            def step(pipe: Any = pipe, x: Any = x, actions: list[dict[str, float]] = actions) -> None:
                tracer = g.tracer
                seen = tracer.num_events
                pipe.step(x if pipe.is_first else None, x if pipe.is_last else None)
                events = tracer.events_since(seen)
                actions.append({e["name"]: e["dur"] / 1e6 for e in events if e["cat"] == "compute"})

            with timed_work(spans, ours=True):
                times, cpu, busy, module_busy, work_busy = _run_steps(
                    step, g.barrier, spans, args.steps, 2 * m * v, 2 * m * v + (m if pipe.is_last else 0)
                )
            rows.append(
                measured(
                    schedule,
                    m,
                    v,
                    times,
                    cpu,
                    split,
                    busy_s=busy[1:],
                    module_busy_s=module_busy[1:],
                    work_busy_s=work_busy[1:],
                    stage_busy_s=[sum(a.values()) for a in actions[1:]],
                    microbatch_group=group,
                    spans=actions[1:],
                    torch_version=torch.__version__,
                )
            )
    return rows
