"""A pipeline's plan: every rank's agreement on the schedule, and this rank's compute ops with their transfers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from paramplane.group import ProcessGroup
from paramplane.node.errors import CollectiveMismatch
from paramplane.parallel.pipeline import schedules
from paramplane.parallel.pipeline.transfers import Message


def agree(
    group: ProcessGroup, schedule: str, microbatches: int, chunks: int, microbatch_group: int | None
) -> None:
    """Every rank must build the same schedule (each derives every rank's list from its own arguments, and a
    receiver knows a message only by its place in that list): the sizes are compared across the group
    first. A rank whose arguments are invalid raises its ValueError, the others a CollectiveMismatch."""
    try:
        group_size = schedules.check(schedule, group.size, microbatches, chunks, microbatch_group)
        error: ValueError | None = None
    except ValueError as exc:
        group_size, error = -1, exc
    known = schedules.SCHEDULES.index(schedule) if schedule in schedules.SCHEDULES else -1
    mine = np.array([error is None, known, microbatches, chunks, group_size], np.int64)
    every = group.all_gather(mine).reshape(group.size, -1).tolist()
    if error is not None:
        raise error
    bad = [r for r, row in enumerate(every) if not row[0]]
    if bad:
        raise CollectiveMismatch(
            f"pipeline: group ranks {bad} of '{group.name}' passed arguments their schedule refuses (see their "
            "ValueError); every rank must build the same pipeline"
        )
    names = ("schedule", "microbatches", "stage modules (chunks)", "microbatch_group")
    for i, name in enumerate(names, start=1):
        values = [row[i] for row in every]
        if len(set(values)) != 1:
            if name == "schedule":
                values = [schedules.SCHEDULES[v] for v in values]
            raise CollectiveMismatch(
                f"pipeline ranks disagree on {name}: {dict(enumerate(values))} (group ranks of '{group.name}'); "
                "every rank must pass the same schedule, microbatches, number of stage modules and group"
            )


def _message(action: schedules.Action, num_ranks: int) -> Message:
    """The message a send or receive action moves."""
    kind, sender, microbatch = schedules.message(action)
    return Message(sender % num_ranks, kind, sender, microbatch)


def incoming(lists: list[list[schedules.Action]], rank: int) -> dict[int, list[Message]]:
    """What ``rank`` receives from each other rank, in the order that rank sends it."""
    p = len(lists)
    return {
        src: [
            _message(a, p)
            for a in lists[src]
            if a.kind.startswith("SEND") and schedules.peer_stage(a) % p == rank
        ]
        for src in range(p)
        if src != rank
    }


class Op(NamedTuple):
    """A forward or backward of one stage and microbatch, with its transfers: take ``incoming`` first (None:
    the input is here), then send the result to group rank ``dst`` (None: it stays here)."""

    forward: bool
    stage: int
    microbatch: int
    module: Any
    incoming: Message | None
    dst: int | None
    name: str


def compile_ops(actions: Sequence[schedules.Action], modules: Sequence[Any], rank: int, p: int) -> list[Op]:
    """``actions`` as compute ops with their transfers fused in: each receive just before the compute it
    feeds, each send right after the compute that makes it (receiving later or sending sooner than the
    schedule says cannot deadlock: receiver threads take messages as they come, sends never wait)."""
    mine = {(a.kind, a.stage, a.microbatch) for a in actions}
    ops = []
    for a in actions:
        if a.kind not in ("F", "B"):
            continue
        forward = a.kind == "F"
        recv = ("RECV_F" if forward else "RECV_B", a.stage, a.microbatch)
        send = ("SEND_F" if forward else "SEND_B", a.stage, a.microbatch)
        incoming = _message(schedules.Action(*recv), p) if recv in mine else None
        target = (a.stage + 1 if forward else a.stage - 1) % p
        ops.append(
            Op(
                forward,
                a.stage,
                a.microbatch,
                modules[a.stage // p],
                incoming if incoming is not None and incoming.src != rank else None,
                target if send in mine and target != rank else None,
                str(a),
            )
        )
    return ops


def nbytes(obj: Any) -> int:
    """Bytes of the arrays in a forward state (nested dicts, lists and tuples of them)."""
    if type(obj) is dict:
        obj = obj.values()
    elif not isinstance(obj, (list, tuple)):
        return int(obj.nbytes) if hasattr(obj, "nbytes") and hasattr(obj, "shape") else 0
    total = 0
    for v in obj:
        total += nbytes(v)
    return total
