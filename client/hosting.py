"""Finding or hosting the coordinator of a job started by Slurm, MPI or torch's env:// names.

Rank 0 (or the first node's launcher) hosts the coordinator in-process, as torch's TCPStore master does; the
others find it at the address ``placement.resolve`` derived, or (single-host MPI) in a 0600 file that rank 0
writes under a 0700 directory named by the job id. The token never travels in argv or in another process's
environment: it comes from ``PARAMPLANE_TOKEN_FILE`` / ``PARAMPLANE_TOKEN``, else rank 0 generates one and
shares it through a 0600 file (the rendezvous file, or ``<job dir>/<job>.token`` for Slurm).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from paramplane.placement import FILE_RENDEZVOUS, Placement
from paramplane.protos.net import is_loopback, parse_address

if TYPE_CHECKING:
    from paramplane.coordinator.server import CoordinatorThread

_POLL_S = 0.05
JOB_DIR_ENV = "PARAMPLANE_JOB_DIR"


def rendezvous_dir(key: str, env: Mapping[str, str]) -> Path:
    """The 0700 directory where the ranks of one single-host job meet (``$PARAMPLANE_JOB_DIR`` or under /tmp)."""
    base = Path(env.get(JOB_DIR_ENV) or Path(tempfile.gettempdir()) / f"paramplane-{os.getuid()}")
    path = base / key
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_uid != os.getuid() or path.stat().st_mode & 0o077:
        raise ValueError(f"{path} must belong to this user with mode 0700 (it holds the job token)")
    return path


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, readable by this user only."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def wait_file(path: Path, deadline: float, what: str) -> str:
    """The content of ``path`` once it exists; ValueError naming ``what`` at ``deadline``."""
    while True:
        with contextlib.suppress(FileNotFoundError):
            text = path.read_text()
            if text:
                return text
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: {path} did not appear in time")
        time.sleep(_POLL_S)


def slurm_token(env: Mapping[str, str], creator: bool, deadline: float) -> str:
    """The token of a Slurm job: ``<job dir>/slurm-<job id>.token`` (job dir: ``$PARAMPLANE_JOB_DIR``, else
    ``$SLURM_SUBMIT_DIR/.paramplane``, a directory every node sees); rank 0 creates it once per job."""
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "0"
    base = env.get(JOB_DIR_ENV) or os.path.join(env.get("SLURM_SUBMIT_DIR") or os.getcwd(), ".paramplane")
    folder = Path(base)
    path = folder / f"slurm-{job}.token"
    if creator and not path.exists():
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_private(path, secrets.token_hex(16))
    return wait_file(
        path, deadline, "the job token (rank 0 writes it; set PARAMPLANE_TOKEN_FILE to give one)"
    ).strip()


class Hosted:
    """The coordinator this process found or started; ``stop()`` after the world is over."""

    def __init__(
        self, address: str, token: str | None, thread: CoordinatorThread | None, published: Path | None = None
    ) -> None:
        self.address = address
        self.token = token
        self.thread = thread
        self.published = published  # the rendezvous file this process wrote (removed on stop)

    def stop(self, wait_s: float = 30.0) -> None:
        """Stop a coordinator hosted here once every rank left the world (at most ``wait_s`` seconds: the
        others may still be saying goodbye when rank 0 is done)."""
        if self.thread is None:
            return
        if self.published is not None:
            with contextlib.suppress(OSError):
                self.published.unlink()
        _, port = parse_address(self.thread.address)
        with contextlib.suppress(Exception):
            _wait_world_over(f"127.0.0.1:{port}", self.token, wait_s)
        self.thread.stop(1.0)


def _wait_world_over(address: str, token: str | None, wait_s: float) -> None:
    from paramplane.node.coord_client import CoordinatorClient, ask_coordinator

    async def wait(client: CoordinatorClient) -> None:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            status = await client.status()
            if not status.formed or status.aborted or all(r.left for r in status.ranks):
                return
            await asyncio.sleep(0.1)  # polling the coordinator's view, not synchronisation

    ask_coordinator(address, token, wait, timeout_s=5.0)


def _start(
    host: str, port: int, world_size: int, token: str | None, join_timeout_s: float
) -> CoordinatorThread:
    from paramplane.coordinator.server import CoordinatorConfig, CoordinatorThread

    thread = CoordinatorThread(
        CoordinatorConfig(
            host=host, port=port, world_size=world_size, token=token, join_timeout_s=join_timeout_s
        )
    )
    try:
        thread.start()
    except OSError as error:
        raise OSError(f"rank 0 cannot host the coordinator on {host}:{port}: {error}") from None
    return thread


def find_or_host(
    placement: Placement, token: str | None, join_timeout_s: float, env: Mapping[str, str]
) -> Hosted:
    """The coordinator of ``placement`` (whose ``coordinator`` is set): started here when this process hosts
    it, else found; waits at most ``join_timeout_s`` for rank 0 to publish it."""
    assert placement.coordinator is not None and placement.world_size is not None
    where = str(placement.coordinator.value)
    size = int(placement.world_size.value)
    deadline = time.monotonic() + join_timeout_s
    if where.startswith(FILE_RENDEZVOUS):
        path = rendezvous_dir(where[len(FILE_RENDEZVOUS) :], env) / "coordinator"
        if placement.hosts_coordinator:
            token = token or secrets.token_hex(16)
            thread = _start("127.0.0.1", 0, size, token, join_timeout_s)
            write_private(path, f"{thread.address}\n{token}\n")
            return Hosted(thread.address, token, thread, path)
        address, _, shared = wait_file(
            path, deadline, f"rank 0 did not publish the coordinator within {join_timeout_s:g} s"
        ).partition("\n")
        return Hosted(address.strip(), token or shared.strip() or None, None)
    host, port = parse_address(where)
    named = "PARAMPLANE_COORDINATOR" in placement.coordinator.source  # a running one: its token is the user's
    if token is None and placement.launcher == "slurm" and not named:
        token = slurm_token(env, placement.hosts_coordinator, deadline)
    if token is None and not is_loopback(host):
        raise ValueError(
            f"the coordinator at {where} ({placement.coordinator.source}) is not on loopback: give the job token "
            "in a 0600 file named by PARAMPLANE_TOKEN_FILE"
        )
    if not placement.hosts_coordinator:
        return Hosted(where, token, None)
    bind = "127.0.0.1" if is_loopback(host) else "0.0.0.0"
    thread = _start(bind, port, size, token, join_timeout_s)
    return Hosted(where, token, thread)
