"""``mpirun -np N python script.py`` with ``pp.init()`` and no other setup (Open MPI, run for real).

``make test-mpi`` installs Open MPI from Debian's packages (root) and runs this; the tests that need ``mpirun``
skip only where it is not installed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "workers" / "scheduled_ddp.py"


def _mpirun() -> str:
    found = shutil.which("mpirun")
    if found is None:
        pytest.skip(
            "Open MPI's mpirun is not installed (make test-mpi installs it: apt-get install openmpi-bin)"
        )
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_mpi(tmp_path: Path, *extra: str, timeout: float = 120) -> list[dict[str, object]]:
    argv = [_mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", "3", *extra]
    argv += [sys.executable, str(WORKER), str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PARAMPLANE_", "SLURM_", "OMPI_"))}
    env |= {
        "PARAMPLANE_JOB_DIR": str(tmp_path / "job"),
        "PARAMPLANE_JOIN_TIMEOUT": "60",
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]


def test_mpirun_ddp_single_host(tmp_path: Path) -> None:
    """Rank 0 hosts the coordinator and publishes it in a 0600 file under the job's 0700 directory."""
    seen = _run_mpi(tmp_path)
    assert [s["rank"] for s in seen] == [0, 1, 2] and {s["world_size"] for s in seen} == {3}
    assert [s["local_rank"] for s in seen] == [0, 1, 2]
    assert not any(s["token_in_env"] for s in seen)
    job_dirs = list((tmp_path / "job").iterdir())
    assert len(job_dirs) == 1 and job_dirs[0].stat().st_mode & 0o777 == 0o700
    assert not (job_dirs[0] / "coordinator").exists(), "rank 0 leaves its rendezvous file behind"


def test_mpirun_ddp_master_addr(tmp_path: Path) -> None:
    """torch's env:// names: rank 0 hosts the coordinator at MASTER_ADDR:MASTER_PORT (as TCPStore's master)."""
    port = _free_port()
    seen = _run_mpi(tmp_path, "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={port}")
    assert {s["world_size"] for s in seen} == {3}
    assert not (tmp_path / "job").exists(), "with MASTER_ADDR the ranks need no rendezvous directory"


def _init_alone(env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    code = "import paramplane as pp\npp.init()"
    base = {
        k: v for k, v in os.environ.items() if not k.startswith(("PARAMPLANE_", "SLURM_", "OMPI_", "PMI_"))
    }
    return subprocess.run(
        [sys.executable, "-c", code], env=base | env, capture_output=True, text=True, timeout=timeout
    )


def test_rank_without_coordinator_is_a_clear_error() -> None:
    """An MPI rank on several hosts with no address to meet at: ValueError naming what to set, at once."""
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    done = _init_alone(env)
    assert done.returncode != 0
    assert "OMPI_COMM_WORLD_RANK=1" in done.stderr and "MASTER_ADDR" in done.stderr, done.stderr


def test_rank_zero_never_publishes(tmp_path: Path) -> None:
    """Rank 1 of a single-host job whose rank 0 never comes: RendezvousError within the join timeout."""
    env = {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "PMIX_NAMESPACE": "lonely",
        "PARAMPLANE_JOB_DIR": str(tmp_path),
        "PARAMPLANE_JOIN_TIMEOUT": "2",
    }
    start = time.monotonic()
    done = _init_alone(env)
    assert done.returncode != 0 and "RendezvousError" in done.stderr, done.stderr
    assert "rank 0 did not publish the coordinator within 2 s" in done.stderr
    assert time.monotonic() - start < 30
