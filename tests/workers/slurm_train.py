"""examples/train_multinode.py as a Slurm job whose first run stalls after its first checkpoint.

Usage: ``slurm_train.py ARGS...`` (train_multinode's). On the job's first run (no ``SLURM_RESTART_COUNT``) and
with ``--stall``, every rank blocks after the first committed checkpoint, so the test can kill a node while
the job is mid-run; the requeued run (``SLURM_RESTART_COUNT=1``) resumes from that checkpoint and finishes.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

import paramplane as pp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train_multinode

STALL_S = 300.0  # bounded: the test kills a node long before


def main() -> int:
    argv = sys.argv[1:]
    stall = "--stall" in argv and not os.environ.get("SLURM_RESTART_COUNT")
    argv = [a for a in argv if a != "--stall"]
    if stall:
        save = pp.checkpoint.save

        def save_then_stall(*args: Any, **kwargs: Any) -> Any:
            path = save(*args, **kwargs)
            print(f"stalling after {path}", flush=True)
            threading.Event().wait(STALL_S)
            raise SystemExit(f"the node was not killed within {STALL_S} s")

        pp.checkpoint.save = save_then_stall
    return train_multinode.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
