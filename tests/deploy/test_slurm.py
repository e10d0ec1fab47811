"""Slurm for real: slurmctld and two slurmd nodes, each in a network namespace this test creates.

``make test-slurm`` (root) installs Debian's ``slurm-wlm`` and runs this; it skips only where Slurm cannot be
installed or namespaces cannot be made. Jobs go through ``sbatch`` / ``srun``: the committed
``examples/slurm/train.sbatch`` (one ``paramplane launch --slurm`` per node, HybridShard over 2 nodes x 2 ranks,
to a committed checkpoint), the one-task-per-rank form (``srun python script.py``), and the same sbatch job
with one node killed mid-run and ``--requeue``: it resumes from the checkpoint. Each node runs in its own network
namespace (``nsenter --net``) with its own /etc/hosts, so node names resolve as on a cluster.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _netns import bridged_namespaces

REPO = Path(__file__).resolve().parents[2]
NODES = ("n1", "n2")
pytestmark = [pytest.mark.netns, pytest.mark.cluster]


def _have_slurm() -> bool:
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch")):
        return True
    if os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", "slurm-wlm"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=600,
            check=False,
        )
    return all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch"))


CONF = """ClusterName=pptest
SlurmctldHost={host}({ctl})
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdTimeout=6
JobRequeue=1
MailProg=/bin/true
{nodes}
PartitionName=all Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    """The daemons we started (by PID) and the commands that reach them."""

    def __init__(self, folder: Path, spaces: dict[str, tuple[str, str]]) -> None:
        self.folder = folder
        self.spaces = spaces  # name -> (namespace, address)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PARAMPLANE_"))}
        self.env |= {
            "SLURM_CONF": str(folder / "slurm.conf"),
            "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "OMP_NUM_THREADS": "1",
        }
        self.daemons: dict[str, subprocess.Popen[bytes]] = {}

    def argv(self, name: str, *command: str) -> list[str]:
        """``command`` inside ``name``'s network namespace, with that node's /etc/hosts."""
        ns = self.spaces[name][0]
        script = 'mount --bind "/etc/netns/$0/hosts" /etc/hosts && exec nsenter --net="/run/netns/$0" "$@"'
        return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, ns, *command]

    def start(self, name: str, *daemon: str) -> None:
        log = open(self.folder / f"{name}.stderr", "ab")  # noqa: SIM115 (the daemon keeps it)
        self.daemons[name] = subprocess.Popen(
            self.argv(name, *daemon), env=self.env, stdout=log, stderr=log, start_new_session=True
        )
        log.close()

    def start_node(self, name: str) -> None:
        self.start(name, "slurmd", "-D", "-N", name)

    def kill_node(self, name: str) -> None:
        """The node fails: every process of its namespace (its slurmd and the job's tasks there) dies at once."""
        pids = subprocess.run(
            ["ip", "netns", "pids", self.spaces[name][0]], capture_output=True, text=True, timeout=10
        ).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.daemons.pop(name).wait(10)

    def run(self, *command: str, timeout: float = 30, cwd: Path | None = None) -> str:
        """A client command (sbatch, scontrol, ...) in the controller's namespace."""
        done = subprocess.run(
            self.argv("ctl", *command), env=self.env, capture_output=True, text=True, timeout=timeout, cwd=cwd
        )
        assert done.returncode == 0, f"{command}: {done.stdout}{done.stderr}"
        return done.stdout

    def wait(self, what: str, check: object, timeout: float) -> str:
        """Poll ``check()`` (a callable returning a truthy string) until it answers, at most ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            answer = check()  # type: ignore[operator]
            if answer:
                return str(answer)
            if time.monotonic() > deadline:
                logs = "\n".join(
                    p.read_text()[-1500:] for p in sorted(self.folder.glob("*.log")) if p.is_file()
                )
                pytest.fail(f"{what} within {timeout} s\n{logs}")
            time.sleep(0.5)

    def job(self, job_id: str) -> dict[str, str]:
        text = self.run("scontrol", "show", "job", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def finished(self, job_id: str, timeout: float) -> dict[str, str]:
        ends = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
        self.wait(f"job {job_id} did not end", lambda: self.job(job_id)["JobState"] in ends, timeout)
        return self.job(job_id)

    def idle(self, timeout: float) -> None:
        def every_node_idle() -> bool:
            states = self.run("sinfo", "-h", "-N", "-o", "%N %T").split("\n")
            return sum(line.endswith(" idle") for line in states) == len(NODES)

        self.wait("the nodes did not come up idle", every_node_idle, timeout)

    def sbatch(self, *args: str, cwd: Path) -> str:
        out = self.run("sbatch", "--parsable", *args, cwd=cwd)
        return out.strip().split(";")[0]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    if os.geteuid() != 0 or not all(shutil.which(b) for b in ("ip", "unshare", "nsenter")):
        pytest.skip("needs root, iproute2 and util-linux for network namespaces")
    if not _have_slurm():
        pytest.skip("Slurm is not installed and cannot be (apt-get install slurm-wlm)")
    tag = f"pps{os.getpid() % 10000}"
    subnet = f"10.216.{random.randrange(1, 250)}"
    spaces = {name: (f"{tag}{name}", f"{subnet}.{i + 1}") for i, name in enumerate(("ctl", *NODES))}
    cluster = Cluster(tmp_path, spaces)
    try:
        # Every process we start lives in one of these namespaces: leaving them kills it.
        with bridged_namespaces(tag, spaces, {name: addr for name, (_, addr) in spaces.items()}):
            nodes = "\n".join(f"NodeName={n} NodeAddr={spaces[n][1]} CPUs=2 State=UNKNOWN" for n in NODES)
            (tmp_path / "slurm.conf").write_text(
                CONF.format(
                    host=socket.gethostname(),
                    ctl=spaces["ctl"][1],
                    dir=tmp_path,
                    nodes=nodes,
                    names=",".join(NODES),
                )
            )
            for sub in ("state", "spool"):
                (tmp_path / sub).mkdir()
            cluster.start("ctl", "slurmctld", "-D", "-i")
            for name in NODES:
                cluster.start_node(name)
            cluster.idle(60)
            yield cluster
    finally:
        for proc in cluster.daemons.values():
            proc.wait(10)


def _output(job_dir: Path, job_id: str) -> str:
    return (job_dir / f"paramplane-{job_id}.out").read_text()


@pytest.mark.timeout(300)
def test_slurm_jobs(cluster: Cluster, tmp_path: Path) -> None:
    """The example sbatch (a launcher per node) to a committed checkpoint, then one task per rank (srun -n 4)."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    sbatch = str(REPO / "examples" / "slurm" / "train.sbatch")
    cluster.env |= {"SCRIPT": str(REPO / "examples" / "train_multinode.py"), "CKPT": str(job_dir / "ckpt")}
    job = cluster.sbatch(sbatch, "--steps", "40", cwd=job_dir)
    state = cluster.finished(job, 150)
    out = _output(job_dir, job)
    assert state["JobState"] == "COMPLETED", out[-4000:]
    assert "[rank 0] hosts 2, ranks 4, shard group 2" in out, out[-4000:]
    assert (job_dir / "ckpt" / "step_40" / "manifest.json").is_file()
    token = job_dir / ".paramplane" / f"slurm-{job}.token"
    assert token.stat().st_mode & 0o777 == 0o600
    assert token.read_text() not in out

    per_rank = tmp_path / "per_rank"
    per_rank.mkdir()
    script = per_rank / "ranks.sh"
    worker = REPO / "tests" / "workers" / "scheduled_ddp.py"
    script.write_text(f"#!/bin/sh\nsrun {sys.executable} {worker} {per_rank}\n")
    job = cluster.sbatch(
        "-N2", "--ntasks-per-node=2", "-o", str(per_rank / "out.txt"), str(script), cwd=per_rank
    )
    state = cluster.finished(job, 120)
    assert state["JobState"] == "COMPLETED", (per_rank / "out.txt").read_text()[-4000:]
    seen = [json.loads((per_rank / f"rank{r}.json").read_text()) for r in range(4)]
    assert [(s["host_id"], s["local_rank"]) for s in seen] == [("n1", 0), ("n1", 1), ("n2", 0), ("n2", 1)]
    assert {s["world_size"] for s in seen} == {4}


@pytest.mark.timeout(300)
def test_slurm_requeue_resumes_after_node_failure(cluster: Cluster, tmp_path: Path) -> None:
    """Node n2 dies after the first checkpoint; Slurm requeues the job, which resumes from that checkpoint."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    ckpt = job_dir / "ckpt"
    cluster.env |= {"SCRIPT": str(REPO / "tests" / "workers" / "stall_train.py"), "CKPT": str(ckpt)}
    sbatch = str(REPO / "examples" / "slurm" / "train.sbatch")
    job = cluster.sbatch(sbatch, "--steps", "40", "--stall", cwd=job_dir)
    cluster.wait("no first checkpoint", lambda: (ckpt / "step_20" / "manifest.json").is_file(), 120)
    cluster.kill_node("n2")
    cluster.wait("Slurm did not requeue the job", lambda: cluster.job(job).get("Restarts") == "1", 90)
    cluster.start_node("n2")
    state = cluster.finished(job, 150)
    out = _output(job_dir, job)
    assert state["JobState"] == "COMPLETED", out[-4000:]
    assert "run 1" in out and f"resumed from {ckpt}/step_20 at step 20" in out, out[-4000:]
    assert "[rank 0] hosts 2, ranks 4, shard group 2" in out, out[-4000:]
    assert (ckpt / "step_40" / "manifest.json").is_file()
