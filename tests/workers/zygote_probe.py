"""A torch worker that does what ``tests/test_harness.py`` asks of it (argv[1]), to check how the harness
starts torch ranks (forked from ``tests/_zygote.py``): it reports what a rank sees, exits with a code, raises,
kills itself, or blocks until it is killed."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

import torch

if __name__ == "__main__":
    what = sys.argv[1]
    rank = os.environ["PARAMPLANE_RANK"]
    seen = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "argv": sys.argv[1:],
        "main_file": getattr(sys.modules["__main__"], "__file__", None),
        "cwd": os.getcwd(),
        "tag": os.environ.get("PROBE_TAG"),
        "torch_threads": torch.get_num_threads(),
        "sum": float(torch.arange(10.0).sum()),
    }
    (Path(os.environ["PARAMPLANE_TEST_OUT"]) / f"probe-{rank}.json").write_text(json.dumps(seen))
    print(f"probe rank {rank} says hello", flush=True)
    if what == "exit3":
        sys.exit(3)
    if what == "raise":
        raise RuntimeError("probe failure on purpose")
    if what == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if what == "hang":
        threading.Event().wait()
