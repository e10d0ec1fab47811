"""Pipeline schedules as data: each rank's ordered list of actions, validated before anything runs.

Stages ``0 .. S-1`` (S = ranks x chunks per rank ``v``) sit on ranks in looped placement:
stage ``s`` on rank ``s % p``. Actions are ``F`` / ``B`` (forward / backward of one stage on
one microbatch) and the transfers around them: ``RECV_F`` before a forward whose input comes
from the previous stage, ``SEND_F`` after a forward whose output feeds the next one,
``RECV_B`` / ``SEND_B`` likewise for gradients. Sends are buffered by the data plane, receives
wait; ``validate`` runs every rank's list against that rule and finds any deadlock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
KINDS = ("F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass(frozen=True)
class Action:
    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.microbatch}"


def _compute_order(
    schedule: str, rank: int, p: int, m: int, v: int, group: int
) -> list[tuple[str, int, int]]:
    """This rank's F/B order as (kind, stage, microbatch)."""
    if schedule == "gpipe":
        s = rank
        return [("F", s, i) for i in range(m)] + [("B", s, i) for i in range(m)]
    if schedule == "1f1b":
        s = rank
        warmup = min(p - rank - 1, m)
        order = [("F", s, i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", s, warmup + i), ("B", s, i)]
        return order + [("B", s, i) for i in range(m - warmup, m)]
    # Interleaved 1F1B (Megatron): virtual microbatch k runs on chunk (k // group) % v, microbatches in groups.
    total = m * v

    def forward(k: int) -> tuple[str, int, int]:
        chunk = (k // group) % v
        return ("F", chunk * p + rank, (k // (group * v)) * group + k % group)

    def backward(k: int) -> tuple[str, int, int]:
        chunk = v - 1 - (k // group) % v
        return ("B", chunk * p + rank, (k // (group * v)) * group + k % group)

    warmup = min((p - rank - 1) * 2 + (v - 1) * group, total)
    order = [forward(k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [forward(warmup + i), backward(i)]
    return order + [backward(k) for k in range(total - warmup, total)]


def forward_only(rank: int, num_ranks: int, num_microbatches: int, chunks: int = 1) -> list[Action]:
    """Rank ``rank``'s actions for inference: each microbatch through this rank's stages in turn."""
    order = [
        ("F", s, mb) for mb in range(num_microbatches) for s in range(rank, num_ranks * chunks, num_ranks)
    ]
    return _with_transfers(order, num_ranks * chunks - 1)


def build(
    schedule: str,
    rank: int,
    num_ranks: int,
    num_microbatches: int,
    chunks: int = 1,
    microbatch_group: int | None = None,
) -> list[Action]:
    """Rank ``rank``'s action list (ValueError for a schedule that cannot run with these sizes).

    ``microbatch_group`` (interleaved 1F1B only; default ``num_ranks``, as Megatron's and torch's): how many
    microbatches pass through one chunk before the rank moves to its next chunk. A larger group gives every
    transfer between stages slack (its latency hides behind compute) and keeps more activations alive on the
    early stages; the bubble in theory is the same."""
    group = check(schedule, num_ranks, num_microbatches, chunks, microbatch_group)
    order = _compute_order(schedule, rank, num_ranks, num_microbatches, chunks, group)
    return _with_transfers(order, num_ranks * chunks - 1)


def _with_transfers(order: list[tuple[str, int, int]], last: int) -> list[Action]:
    """A compute order with each compute's receive before it and its send after it (stages ``0 .. last``)."""
    actions: list[Action] = []
    for kind, s, mb in order:
        if kind == "F":
            actions += [Action("RECV_F", s, mb)] if s > 0 else []
            actions.append(Action("F", s, mb))
            actions += [Action("SEND_F", s, mb)] if s < last else []
        else:
            actions += [Action("RECV_B", s, mb)] if s < last else []
            actions.append(Action("B", s, mb))
            actions += [Action("SEND_B", s, mb)] if s > 0 else []
    return actions


def check(
    schedule: str, num_ranks: int, num_microbatches: int, chunks: int, microbatch_group: int | None = None
) -> int:
    """ValueError for sizes the schedule cannot run with; the microbatch group (``num_ranks`` unless given)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    if num_ranks < 1 or num_microbatches < 1 or chunks < 1:
        raise ValueError("ranks, microbatches and chunks per rank must be positive")
    if schedule != "interleaved_1f1b" and chunks != 1:
        raise ValueError(
            f"{schedule} runs one stage per rank; got {chunks} stage modules (use interleaved_1f1b)"
        )
    if schedule != "gpipe" and num_microbatches < num_ranks:
        raise ValueError(
            f"{schedule} needs at least as many microbatches as stages' ranks: {num_microbatches} < {num_ranks}"
        )
    group = num_ranks if microbatch_group is None else microbatch_group
    if microbatch_group is not None and schedule != "interleaved_1f1b":
        raise ValueError(f"microbatch_group is a setting of interleaved_1f1b, not of {schedule}")
    if schedule == "interleaved_1f1b" and num_microbatches % num_ranks:
        raise ValueError(
            f"interleaved_1f1b needs microbatches divisible by the pipeline ranks: {num_microbatches} % {num_ranks}"
        )
    if schedule == "interleaved_1f1b" and (group < num_ranks or num_microbatches % group):
        raise ValueError(
            f"interleaved_1f1b's microbatch_group must be at least the pipeline ranks ({num_ranks}) and divide "
            f"the microbatches ({num_microbatches}); got {group}"
        )
    return group


def validate(lists: list[list[Action]], num_microbatches: int, chunks: int) -> None:
    """ValueError unless every rank's list is complete, ordered, and the ranks together cannot deadlock (a
    receive waits for its own message, which may have been sent before others the rank takes first).

    Every compute that takes its input from another stage has that receive before it, and every compute whose
    result another stage needs has that send after it: a runtime receives right before the compute and sends
    right after it, which then only relaxes the order checked here."""
    p = len(lists)
    stages = p * chunks
    last = stages - 1
    for rank, actions in enumerate(lists):
        done: set[tuple[str, int, int]] = set()
        at: dict[tuple[str, int, int], int] = {}
        for i, a in enumerate(actions):
            if a.kind not in KINDS:
                raise ValueError(f"rank {rank}: unknown action kind {a.kind!r} (one of {', '.join(KINDS)})")
            if not 0 <= a.stage < stages or not 0 <= a.microbatch < num_microbatches:
                raise ValueError(
                    f"rank {rank}: {a} is outside {stages} stages x {num_microbatches} microbatches"
                )
            if (a.kind in ("RECV_F", "SEND_B") and a.stage == 0) or (
                a.kind in ("SEND_F", "RECV_B") and a.stage == last
            ):
                raise ValueError(f"rank {rank}: {a} has no stage at its other end")
            at[(a.kind, a.stage, a.microbatch)] = i
            if a.stage % p != rank:
                raise ValueError(
                    f"rank {rank} runs {a} of stage {a.stage}, which lives on rank {a.stage % p}"
                )
            if a.kind == "B" and ("F", a.stage, a.microbatch) not in done:
                raise ValueError(f"rank {rank}: {a} comes before its forward")
            key = (a.kind, a.stage, a.microbatch)
            if key in done:
                raise ValueError(f"rank {rank}: {a} appears twice")
            done.add(key)
        want = {
            (k, s, mb) for s in range(rank, stages, p) for mb in range(num_microbatches) for k in ("F", "B")
        }
        missing = want - {d for d in done if d[0] in ("F", "B")}
        if missing:
            raise ValueError(f"rank {rank} never runs {sorted(missing)[:4]}")
        for kind, s, mb in sorted(want):
            i = at[(kind, s, mb)]
            if (s > 0 if kind == "F" else s < last) and at.get((f"RECV_{kind}", s, mb), i) >= i:
                raise ValueError(f"rank {rank}: {kind}{s}.{mb} needs RECV_{kind}{s}.{mb} before it")
            if (s < last if kind == "F" else s > 0) and at.get((f"SEND_{kind}", s, mb), i) <= i:
                raise ValueError(f"rank {rank}: {kind}{s}.{mb} needs SEND_{kind}{s}.{mb} after it")
    simulate(lists, lambda _a: 0.0)  # raises where the ranks would deadlock


def simulate(lists: list[list[Action]], duration: Callable[[Action], float]) -> list[float]:
    """Run every rank's list on a clock: ``F``/``B`` take ``duration(action)``, a send arrives at once, a
    receive waits for its send. Returns each rank's finishing time; ValueError where the ranks deadlock.

    With measured compute times this is the step a runtime with free transfers would take: the
    pipeline benchmark tells its stages' own jitter apart from the cost of moving activations with it.
    """
    p = len(lists)
    clock = [0.0] * p
    arrived: dict[tuple[str, int, int], float] = {}
    pos = [0] * p
    while any(pos[r] < len(lists[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pos[r] < len(lists[r]):
                a = lists[r][pos[r]]
                if a.kind in ("RECV_F", "RECV_B"):
                    sent = arrived.get(message(a))
                    if sent is None:
                        break
                    clock[r] = max(clock[r], sent)
                elif a.kind in ("SEND_F", "SEND_B"):
                    arrived[message(a)] = clock[r]
                else:
                    clock[r] += duration(a)
                pos[r] += 1
                moved = True
        if not moved:
            stuck = {r: str(lists[r][pos[r]]) for r in range(p) if pos[r] < len(lists[r])}
            raise ValueError(f"the schedule deadlocks: ranks wait at {stuck}")
    return clock


def peer_stage(a: Action) -> int:
    """The stage at the other end of a transfer."""
    return a.stage + 1 if a.kind in ("SEND_F", "RECV_B") else a.stage - 1


def message(a: Action) -> tuple[str, int, int]:
    """A transfer's message as (direction ``"F"``/``"B"``, sending stage, microbatch)."""
    sender = a.stage if a.kind.startswith("SEND") else peer_stage(a)
    return (a.kind[-1], sender, a.microbatch)


def table(lists: list[list[Action]]) -> str:
    """One line per rank: its compute actions in order (transfers omitted)."""
    return "\n".join(
        f"rank {r}: " + " ".join(str(a) for a in actions if a.kind in ("F", "B"))
        for r, actions in enumerate(lists)
    )


def gpipe_peak_activations(num_ranks: int, num_microbatches: int) -> int:
    """Activation sets GPipe keeps alive on every stage: all microbatches."""
    return num_microbatches


def one_f_one_b_peak_activations(num_ranks: int, num_microbatches: int, rank: int = 0) -> int:
    """Activation sets 1F1B keeps alive on ``rank`` (the first stage holds the most: ``p``)."""
    return min(num_ranks - rank, num_microbatches)
