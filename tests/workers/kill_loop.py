"""One round of the kill loop: every rank runs one kind of collective in a loop; the victim SIGKILLs
itself at a random moment of op number KILL_AT (a timer fires inside or around that op). Survivors run
on until their group fails and report the error, its rank and when they saw it.

Environment: KILL_RANK, KILL_AT, KILL_DELAY_MS, KILL_OP (all_reduce | all_gather | broadcast |
reduce_scatter).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank

import paramplane as pp

MAX_OPS = 10_000


def scenario(world: Any, rep: Report) -> None:
    victim, kill_at = int(os.environ["KILL_RANK"]), int(os.environ["KILL_AT"])
    delay, op = float(os.environ["KILL_DELAY_MS"]) / 1000, os.environ["KILL_OP"]
    g = world.group
    x = np.ones(12 << 16, np.float32)  # 3 MiB (splits evenly over 3 and 4): the ring on gRPC, rounds on shm
    out = np.empty(x.size * g.size, np.float32)
    piece = np.empty(x.size // g.size, np.float32)
    calls = {
        "all_reduce": lambda: g.all_reduce(x),
        "all_gather": lambda: g.all_gather(x, out=out),
        "broadcast": lambda: g.broadcast(x, src=(victim + 1) % g.size),
        "reduce_scatter": lambda: g.reduce_scatter(x, out=piece),
    }
    call = calls[op]
    for i in range(MAX_OPS):
        if world.rank == victim and i == kill_at:
            rep.values["killed_at"] = time.time()
            rep.write()
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        try:
            call()
        except pp.PlaneError as exc:
            rep.values.update(
                error_at=time.time(),
                error_type=type(exc).__name__,
                error_rank=getattr(exc, "rank", None),
                error_text=str(exc),
                num_ops=i,
            )
            return
    rep.check("a collective failed after the victim died", False, f"{MAX_OPS} ops succeeded")


if __name__ == "__main__":
    run_rank(scenario)
