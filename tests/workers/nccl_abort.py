"""NCCL work queued behind a dead peer is released: rank 1 dies after a warm-up; rank 0's all_reduce is already
on its stream, waiting for rank 1. When the world learns of the loss, its NCCL communicators are aborted, so
rank 0's stream synchronisation returns instead of hanging, and its next op raises PeerLost."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank

import paramplane as pp


def scenario(world: Any, rep: Report) -> None:
    import cupy

    world.use_gpu()
    g = world.group
    x = cupy.ones(1 << 22, cupy.float32)
    g.all_reduce(x)
    cupy.cuda.get_current_stream().synchronize()
    rep.check("warm-up all_reduce on NCCL", bool((x == 2).all()))
    g.barrier()
    if world.rank == 1:
        rep.write()
        os.kill(os.getpid(), signal.SIGKILL)
    g.all_reduce(x)  # enqueued; rank 1 will never join
    stream = cupy.cuda.get_current_stream()
    outcome: list[str] = []

    def sync() -> None:
        try:
            stream.synchronize()
            outcome.append("returned")
        except Exception as exc:  # an aborted communicator may surface as a CUDA error
            outcome.append(f"raised {type(exc).__name__}")

    start = time.monotonic()
    waiter = threading.Thread(target=sync, daemon=True)
    waiter.start()
    waiter.join(60)
    rep.values["sync"] = outcome[0] if outcome else "still blocked after 60 s"
    rep.values["sync_s"] = time.monotonic() - start
    rep.check("the stream is released", bool(outcome), rep.values["sync"])
    rep.raises("the next op names the loss", pp.PeerLost, lambda: g.all_reduce(x), "rank 1")


if __name__ == "__main__":
    run_rank(scenario)
