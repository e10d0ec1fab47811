"""examples/train_multinode.py whose first run stalls after its first committed checkpoint.

Usage: ``stall_train.py [--stall | --stall-watch] ARGS...`` (train_multinode's ARGS). A run that finds no
checkpoint when it starts blocks every rank after the first one it commits, so a test can kill a node or a pod
while the job is mid-run; a later run resumes from that checkpoint and finishes. ``--stall`` just waits (Slurm
kills the ranks when it requeues the job); ``--stall-watch`` waits on the coordinator's KV store, which fails
with WorldAborted when a peer is lost, so the rank exits with an error as a real rank would (a Kubernetes Job
then replaces its pod).
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from typing import Any

import paramplane as pp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train_multinode

STALL_S = 300.0  # bounded: the tests kill a node long before


def main() -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--stall", action="store_true")
    parser.add_argument("--stall-watch", action="store_true")
    parser.add_argument("--ckpt", type=Path, default=Path("ckpt"))
    known, _ = parser.parse_known_args()
    argv = [a for a in sys.argv[1:] if a not in ("--stall", "--stall-watch")]
    # Checked before pp.init(): the first checkpoint is collective, so no rank can see it here yet.
    if (known.stall or known.stall_watch) and pp.checkpoint.latest(known.ckpt) is None:
        save, init = pp.checkpoint.save, pp.init
        worlds: list[pp.World] = []

        def init_and_keep(*args: Any, **kwargs: Any) -> pp.World:
            worlds.append(init(*args, **kwargs))
            return worlds[-1]

        def save_then_stall(state: Any, path: Any, group: pp.ProcessGroup, **kwargs: Any) -> Any:
            done = save(state, path, group, **kwargs)
            print(f"stalling after {done}", flush=True)
            if known.stall_watch:  # fails with WorldAborted once a peer is lost
                worlds[0].kv.get("never-set", wait=True, timeout=STALL_S)
            else:
                threading.Event().wait(STALL_S)
            raise SystemExit(f"nothing was killed within {STALL_S} s")

        pp.checkpoint.save = save_then_stall
        pp.init = init_and_keep
    return train_multinode.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
