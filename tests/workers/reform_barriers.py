"""Unnamed barriers after ``world.reform()``: rank 1 dies after the first one, its replacement joins the next
epoch, and the first unnamed barrier of that epoch must meet on the survivor and the replacement alike."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank

import paramplane as pp


def scenario(world: Any, rep: Report) -> None:
    if os.environ.get("PARAMPLANE_REPLACEMENT") != "1":
        world.barrier()  # "world-1" of epoch 1
        if world.rank == 1:
            os._exit(3)  # the harness starts a replacement for rank 1
        rep.raises("the survivor's barrier fails", pp.PlaneError, lambda: world.barrier(timeout=20))
        world.reform(timeout=20)
    rep.values["epoch"] = world.epoch
    try:
        world.barrier(timeout=5)  # the first unnamed barrier of the new epoch, on every rank
        world.barrier(timeout=5)
        rep.check("unnamed barriers meet after reform", True)
    except pp.PlaneError as exc:
        rep.check("unnamed barriers meet after reform", False, f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    run_rank(scenario)
