"""``paramplane launch``: start N rank processes of a script on this host, like torchrun.

Every rank runs ``sys.executable script.py args...`` (or ``-m module``, or with
``--no-python`` the target itself as a program) in its
own process group, with the ``PARAMPLANE_*`` environment that ``pp.init()``
reads. The launcher prefixes each output line with ``[rank i]``, forwards
SIGINT/SIGTERM/SIGHUP, and when one rank fails it stops the others and exits
with that rank's status. Every group it started is gone when it returns.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from paramplane.node.errors import PlaneError
from paramplane.protos.fields import default_of, field_docs
from paramplane.protos.net import (
    check_seconds,
    parse_address,
    prefer_control_latency,
    read_token,
    resolve_token,
)

if TYPE_CHECKING:
    from paramplane.agent_server import AgentThread
    from paramplane.coordinator.server import CoordinatorThread

# glibc keeps blocks up to 32 MiB in its heap and up to 64 MiB free at the heap's top instead of returning
# them to the OS: chunk buffers are reused without page faults (DESIGN.md Wire). The trim threshold was 1 GiB
# until 2026-11-26: it kept a torch training step's freed memory resident (GPT-2 peak +25-100 MB per rank)
# and the collectives were no faster for it. Only defaults: a user's own setting wins.
MALLOC_DEFAULTS = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "67108864"}
# BLAS pools sized for the whole machine in every rank oversubscribe the cores (a 4-rank demo on
# 2 cores ran 5x slower); ranks get cores // ranks threads unless the user chose.
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def thread_env(num_local_ranks: int) -> dict[str, str]:
    """The intra-op thread counts (OpenMP, OpenBLAS, MKL) for each of ``num_local_ranks`` ranks sharing this
    machine's cores: an equal share, at least one. A rank left at the libraries' default (every core) with
    others beside it oversubscribes the cores, and OpenMP's spinning workers then slow every rank down many
    times over; torchrun sets ``OMP_NUM_THREADS=1`` for the same reason. Callers ``setdefault`` these: an
    explicit setting wins."""
    threads = str(max(1, (os.cpu_count() or 1) // max(1, num_local_ranks)))
    return {var: threads for var in THREAD_VARS}


FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_MAX_LINE = 1 << 16
_POLL_S = 0.05


@dataclass(frozen=True)
class LaunchConfig:
    """What ``paramplane launch`` starts and how it supervises it."""

    num_ranks: int
    """Rank processes to start on this host (``-n``)."""
    target: str
    """Path of the script to run, or the module name when ``module`` is set."""
    args: tuple[str, ...] = ()
    """Arguments passed to every rank's script."""
    module: bool = False
    """Run ``target`` as ``python -m target``."""
    no_python: bool = False
    """Run ``target`` as a program (a path, or a name on ``PATH``) with ``args``, not as a Python script:
    a wrapper that starts the script itself (torchrun's ``--no-python``)."""
    standalone: bool = False
    """Start an embedded coordinator on a free port of 127.0.0.1 for this launch."""
    coordinator: str | None = None
    """HOST:PORT of a running coordinator (exclusive with ``standalone``)."""
    world_size: int | None = None
    """Ranks in the whole job, on every host; ``None`` means ``num_ranks`` (a single-host job)."""
    host_id: str | None = None
    """Identity of this host for rank grouping; ``None`` means ``socket.gethostname()``."""
    token: str | None = field(default=None, repr=False)
    """Job token; ``None``: the file ``$PARAMPLANE_TOKEN_FILE`` names, else ``$PARAMPLANE_TOKEN``, else a
    fresh random one when standalone, else none (what ``pp.init`` would read)."""
    timeout_s: float | None = None
    """Passed to ranks as ``PARAMPLANE_TIMEOUT`` (the default collective timeout) when set."""
    join_timeout_s: float | None = None
    """How long the world may take to form: the ranks' ``PARAMPLANE_JOIN_TIMEOUT`` and the embedded
    coordinator's join timeout (``None``: their defaults)."""
    heartbeat_timeout_s: float | None = None
    """Embedded coordinator: silence after which a rank counts as dead (``None``: its default)."""
    http_port: int | None = None
    """Embedded coordinator: serve its live view (page, /metrics, /api/status) on this port of 127.0.0.1
    (0: a free one); the address is printed. ``None``: no view."""
    prefix: bool = True
    """Each output line starts with ``[rank i] ``; ``--no-prefix`` (False) passes the ranks' output through untouched."""
    grace_s: float = 5.0
    """Seconds between SIGTERM and SIGKILL when stopping ranks (and the coordinator's stop grace)."""
    max_restarts: int = 0
    """After a rank fails, stop the others and start every rank again this many times at most (like
    torchrun's ``--max-restarts``). Each attempt is a new world: a fresh embedded coordinator, or, with
    ``--coordinator``, the next epoch of that coordinator (the launcher aborts the failed world there, so
    every host's ranks fail and their launchers restart too). Ranks see the attempt number in
    ``PARAMPLANE_RESTART_COUNT`` and resume from ``pp.checkpoint.latest``."""
    first_rank: int | None = None
    """Global rank of this host's first rank, on a job of several hosts (``--slurm``: node index times ``-n``);
    ``None``: the coordinator numbers them (``PARAMPLANE_RANK=-1``)."""
    restart_base: int = 0
    """Added to the attempt number in ``PARAMPLANE_RESTART_COUNT`` (``--slurm``: ``SLURM_RESTART_COUNT``)."""
    agent: bool = True
    """With ``--coordinator``: this launcher is its host's agent. The ranks call it on a Unix socket and it
    calls the coordinator once per host (joins together, one heartbeat per interval for all ranks, one watch
    stream, barriers batched), so the coordinator's load grows with hosts, not ranks; a rank that dies is
    reported at once. ``--no-agent``: every rank calls the coordinator itself."""
    max_replacements: int = 0
    """After a rank fails, start a replacement for that rank alone (this many times at most, in all) while
    the other ranks go on: they re-form the world in process (``world.reform()``) and bring the
    replacement, which sees ``PARAMPLANE_REPLACEMENT=1``, up to date live (``pp.checkpoint.sync``).
    Used before ``max_restarts``."""

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"-n must be at least 1, got {self.num_ranks}")
        if not self.target:
            raise ValueError("name a script to run (or -m MODULE)")
        if self.module and self.no_python:
            raise ValueError("-m and --no-python exclude each other")
        if self.no_python:
            if shutil.which(self.target) is None:
                raise ValueError(f"no such program (or not executable): {self.target!r}")
        elif not self.module and not Path(self.target).is_file():
            raise ValueError(f"no such script: {self.target!r}")
        if self.standalone == (self.coordinator is not None):
            raise ValueError("pass exactly one of --standalone or --coordinator HOST:PORT")
        if self.coordinator is not None:
            parse_address(self.coordinator)
        if self.world_size is not None and self.world_size < self.num_ranks:
            raise ValueError(f"--world-size {self.world_size} is smaller than -n {self.num_ranks}")
        if self.standalone and self.world_size not in (None, self.num_ranks):
            raise ValueError(
                "--standalone binds its coordinator to 127.0.0.1, so every rank runs on this host: "
                f"--world-size must equal -n ({self.num_ranks}); use --coordinator for several hosts"
            )
        if not self.standalone and self.heartbeat_timeout_s is not None:
            raise ValueError("--heartbeat-timeout configures the --standalone coordinator only")
        if not self.standalone and self.http_port is not None:
            raise ValueError("--http-port configures the --standalone coordinator only")
        for name, value in (
            ("--timeout", self.timeout_s),
            ("--join-timeout", self.join_timeout_s),
            ("--heartbeat-timeout", self.heartbeat_timeout_s),
        ):
            if value is not None:
                check_seconds(value, name)  # the ranks' own limit
        if not self.grace_s >= 0:
            raise ValueError(f"grace must be >= 0 seconds, got {self.grace_s}")
        if self.host_id is not None and (not self.host_id or any(c.isspace() for c in self.host_id)):
            raise ValueError(f"--host-id must be a non-empty name without spaces, got {self.host_id!r}")
        if self.token is not None and not self.token:
            raise ValueError("the job token is empty")
        for name, count in (
            ("--max-restarts", self.max_restarts),
            ("--max-replacements", self.max_replacements),
        ):
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"{name} must be a whole number >= 0, got {count!r}")

    @property
    def total_ranks(self) -> int:
        """The job's world size: ``world_size``, or ``num_ranks`` for a single-host job."""
        return self.num_ranks if self.world_size is None else self.world_size


KILLED_GRACE_S = 1.0
"""When a rank exits with a failure code, how long the launcher looks for a host-mate killed by a signal (the
likely cause) to report to the coordinator before stopping the others."""
COORDINATOR_PROBE_S = 10.0
"""How long the launcher waits for an external coordinator to answer before a restart."""


def _reason(exc: BaseException) -> str:
    """One line for an error: a gRPC error's status code and the first line of its details."""
    code = getattr(exc, "code", None)
    details = getattr(exc, "details", None)
    if callable(code) and callable(details):
        first = (details() or "").strip().splitlines()
        return f"{code().name}: {first[0]}" if first else str(code().name)
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def describe_exit(returncode: int) -> str:
    """``exited with code 3`` or ``was killed by SIGKILL`` for a ``Popen.returncode``."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"was killed by {name}"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _binary_writer(stream: IO[str]) -> Callable[[bytes], None]:
    buffer: IO[bytes] | None = getattr(stream, "buffer", None)

    def write(data: bytes) -> None:
        if buffer is not None:
            stream.flush()
            buffer.write(data)
            buffer.flush()
        else:
            stream.write(data.decode(errors="replace"))
            stream.flush()

    return write


def _pump(source: IO[bytes], write: Callable[[bytes], None], lock: threading.Lock, prefix: bytes) -> None:
    """Copy ``source`` line by line to ``write``, each line prefixed; a partial last line gets a newline."""
    at_line_start = True
    with source:
        for piece in iter(lambda: source.readline(_MAX_LINE), b""):
            out = prefix + piece if at_line_start else piece
            at_line_start = piece.endswith(b"\n")
            if not at_line_start and len(piece) < _MAX_LINE:  # short read without newline: EOF
                out += b"\n"
                at_line_start = True
            _write_quietly(write, lock, out)
        if not at_line_start:  # the last line filled a whole read exactly
            _write_quietly(write, lock, b"\n")


def _write_quietly(write: Callable[[bytes], None], lock: threading.Lock, data: bytes) -> None:
    try:
        with lock:
            write(data)
    except (OSError, ValueError):
        pass  # our stdout is gone; keep draining so the rank never blocks on a full pipe


def _live_process_groups() -> set[int] | None:
    """Process group ids that have a running (non-zombie) member, or ``None`` without ``/proc``."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    groups: set[int] = set()
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat_file:
                stat = stat_file.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()  # state, ppid, pgrp, ...
        if fields[0] != b"Z":
            groups.add(int(fields[2]))
    return groups


def _embedded_coordinator(config: LaunchConfig, token: str | None) -> CoordinatorThread:
    """The ``--standalone`` coordinator, on a free port of 127.0.0.1 (not started yet)."""
    from paramplane.coordinator.server import CoordinatorConfig, CoordinatorThread  # only when used

    settings = CoordinatorConfig(host="127.0.0.1", port=0, world_size=config.total_ranks, token=token)
    if config.join_timeout_s is not None:
        settings = dataclasses.replace(settings, join_timeout_s=config.join_timeout_s)
    if config.heartbeat_timeout_s is not None:
        settings = dataclasses.replace(settings, heartbeat_timeout_s=config.heartbeat_timeout_s)
    if config.http_port is not None:
        settings = dataclasses.replace(settings, http_port=config.http_port)
    return CoordinatorThread(settings)


def _host_agent(config: LaunchConfig, coordinator: str, token: str | None) -> AgentThread:
    """This host's agent in front of ``coordinator`` (not started yet)."""
    from paramplane.agent_server import AgentThread  # only when used
    from paramplane.protos.net import tls_paths

    ca = tls_paths()["CA"]
    return AgentThread(
        coordinator,
        host_id=_host_id(config),
        num_local=config.num_ranks,
        token=token,
        tls_root_cert=Path(ca).read_bytes() if ca else None,
    )


def _host_id(config: LaunchConfig) -> str:
    return config.host_id or os.environ.get("PARAMPLANE_HOST_ID") or socket.gethostname()


class _Rank:
    def __init__(self, index: int, process: subprocess.Popen[bytes]) -> None:
        self.index = index
        self.process = process
        self.returncode: int | None = None  # set when the leader exits; it stays unreaped until stopped
        self.reaped = False
        self.threads: list[threading.Thread] = []


class Launcher:
    """Runs one launch: starts the coordinator and ranks, supervises them, stops everything."""

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self._ranks: list[_Rank] = []
        self._events: queue.SimpleQueue[tuple[str, int, int]] = queue.SimpleQueue()
        self._signal: int | None = None  # the first signal received
        self._num_signals = 0
        self._num_replacements = 0
        self._token_generated = False
        self._view_file: str | None = (
            None  # holds the live view's URL with a made-up token (removed at the end)
        )
        self._out = _binary_writer(sys.stdout)
        self._err = _binary_writer(sys.stderr)
        self._locks = (threading.Lock(), threading.Lock())
        self._agent: AgentThread | None = None

    def run(self) -> int:
        """Launch, wait, stop; return the launcher's exit status."""
        config = self.config
        token = resolve_token(config.token)
        self._token_generated = token is None and config.standalone
        if token is None and config.standalone:
            token = secrets.token_hex(16)
        previous = self._install_signal_handlers()
        code, message = 1, None
        try:
            for attempt in range(config.max_restarts + 1):
                code, message = self._attempt(token, attempt)
                if code == 0 or self._signal is not None or attempt == config.max_restarts:
                    break
                if config.coordinator is not None:
                    gone = self._coordinator_gone(config.coordinator, token)
                    if gone is not None:  # restarted ranks would only wait in pp.init() for the join timeout
                        message = f"{gone}; not restarting ({message or 'a rank failed'})"
                        break
                with self._locks[1]:
                    self._err(
                        f"paramplane launch: {message}; restarting every rank (restart {attempt + 1} of "
                        f"{config.max_restarts})\n".encode()
                    )
                if config.coordinator is not None:
                    self._abort_world(config.coordinator, token, message or "a rank failed")
                self._ranks = []
                self._events = queue.SimpleQueue()  # exits of the stopped attempt must not reach the next
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            if self._view_file is not None:
                Path(self._view_file).unlink(missing_ok=True)
        if message is not None:
            with self._locks[1]:
                self._err(f"paramplane launch: {message}\n".encode())
        return code

    def _attempt(self, token: str | None, attempt: int) -> tuple[int, str | None]:
        """Start the coordinator (standalone) and every rank, supervise them, stop everything."""
        config = self.config
        coordinator: CoordinatorThread | None = None
        self._agent = None
        code, message = 1, None
        try:
            if config.standalone:
                coordinator = _embedded_coordinator(config, token)
                address = coordinator.start()
                if coordinator.http_address is not None:
                    self._announce_view(coordinator.http_address, token)
            else:
                assert config.coordinator is not None
                address = config.coordinator
                if config.agent:
                    self._agent = _host_agent(config, address, token)
                    self._agent.start()
            for index in range(config.num_ranks):
                if self._signal is not None:
                    break
                self._start_rank(index, address, token, attempt)
            code, message = self._supervise(
                lambda index: self._start_rank(index, address, token, attempt, True)
            )
        finally:
            try:
                self._stop_all(self._signal or signal.SIGTERM)
            finally:
                # Pipes reach EOF once the groups are gone; a process that left its group may hold them.
                deadline = time.monotonic() + 2.0
                for rank in self._ranks:
                    for thread in rank.threads:
                        thread.join(timeout=max(0.0, deadline - time.monotonic()))
                if self._agent is not None:
                    self._agent.stop()
                if coordinator is not None:
                    coordinator.stop(min(config.grace_s, 1.0))
        return code, message

    def _announce_view(self, address: str, token: str | None) -> None:
        """Print where the live view is; the URL with a token the launcher made up goes to a private file."""
        line = f"paramplane launch: live view on http://{address}/"
        if token is not None and self._token_generated:
            if self._view_file is None:
                fd, self._view_file = tempfile.mkstemp(prefix="paramplane-view-", suffix=".url")  # mode 0600
                os.close(fd)
            path = self._view_file
            Path(path).write_text(f"http://{address}/?token={token}\n")
            line += f" (the URL with this launch's token is in {path})"
        elif token is not None:
            line += " (add ?token=<the job token>)"
        with self._locks[1]:
            self._err(f"{line}\n".encode())

    def _abort_world(self, address: str, token: str | None, reason: str) -> None:
        """Abort the failed world on the coordinator, in the name of one of our ranks that was in it.

        Every host's ranks then fail at once (their launchers restart them too), and the restarted ranks'
        joins open the next epoch instead of finding the old world full.
        """
        from paramplane.node.coord_client import CoordinatorClient, ask_coordinator

        pids = {r.process.pid for r in self._ranks}

        async def abort(client: CoordinatorClient) -> None:
            status = await client.status()
            ours = [r.rank for r in status.ranks if r.pid in pids]
            if status.formed and not status.aborted and ours:
                await client.abort_epoch(status.epoch, ours[0], f"launcher restarts: {reason}")

        try:
            ask_coordinator(address, token, abort, timeout_s=10.0)
        except Exception as exc:  # the restart still happens; the coordinator's liveness checks catch up
            with self._locks[1]:
                self._err(
                    f"paramplane launch: could not abort the world on {address}: {_reason(exc)}\n".encode()
                )

    def _coordinator_gone(self, address: str, token: str | None) -> str | None:
        """None when the coordinator answers a status query within ``COORDINATOR_PROBE_S``, else one line
        saying it does not (the launcher then stops instead of restarting ranks that could never join)."""
        from paramplane.node.coord_client import CoordinatorClient, ask_coordinator

        async def probe(client: CoordinatorClient) -> None:
            await client.status(wait_for_ready=True)

        try:
            ask_coordinator(address, token, probe, timeout_s=COORDINATOR_PROBE_S)
        except Exception as exc:
            return f"the coordinator at {address} did not answer within {COORDINATOR_PROBE_S:g} s ({_reason(exc)})"
        return None

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def on_signal(signum: int, _frame: object) -> None:
            if self._signal is None:
                self._signal = signum
            self._num_signals += 1
            self._events.put(("signal", signum, 0))  # SimpleQueue.put is safe in a signal handler

        return {signum: signal.signal(signum, on_signal) for signum in FORWARDED_SIGNALS}

    def _start_rank(
        self, index: int, address: str, token: str | None, attempt: int = 0, replacement: bool = False
    ) -> None:
        config = self.config
        env = dict(os.environ)
        for stale in ("PARAMPLANE_RANK", "PARAMPLANE_TOKEN", "PARAMPLANE_TOKEN_FILE"):
            env.pop(stale, None)  # an outer rank hint would be wrong here; the token is resolved already
        for key, value in MALLOC_DEFAULTS.items():
            env.setdefault(key, value)
        for var, threads in thread_env(config.num_ranks).items():
            env.setdefault(var, threads)
        env.update(
            PARAMPLANE_COORDINATOR=address,
            PARAMPLANE_WORLD_SIZE=str(config.total_ranks),
            PARAMPLANE_HOST_ID=_host_id(config),
            PARAMPLANE_LOCAL_RANK=str(index),
            PARAMPLANE_RESTART_COUNT=str(config.restart_base + attempt),
            PYTHONUNBUFFERED="1",
        )
        if token is not None:  # without one, only a tokenless coordinator on loopback admits the ranks
            env["PARAMPLANE_TOKEN"] = token
        if config.total_ranks == config.num_ranks:
            env["PARAMPLANE_RANK"] = str(index)
        else:  # -1: the coordinator numbers them (a scheduler's rank variables must not speak for it)
            env["PARAMPLANE_RANK"] = "-1" if config.first_rank is None else str(config.first_rank + index)
        if config.timeout_s is not None:
            env["PARAMPLANE_TIMEOUT"] = str(config.timeout_s)
        if config.join_timeout_s is not None:
            env["PARAMPLANE_JOIN_TIMEOUT"] = str(config.join_timeout_s)
        if replacement:
            env["PARAMPLANE_REPLACEMENT"] = "1"
        env.pop("PARAMPLANE_AGENT", None)
        if self._agent is not None:
            env["PARAMPLANE_AGENT"] = self._agent.address
        python = [] if config.no_python else [sys.executable, *(["-m"] if config.module else [])]
        argv = [*python, config.target, *config.args]
        pipe = subprocess.PIPE if config.prefix else None
        process = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=pipe, stderr=pipe, start_new_session=True
        )
        rank = _Rank(index, process)
        if replacement:
            self._ranks[index] = rank
        else:
            self._ranks.append(rank)
        targets: list[Any] = [(self._wait_leader, (rank, self._events))]
        if config.prefix:
            assert process.stdout is not None and process.stderr is not None
            prefix = f"[rank {index}] ".encode()
            targets.append((_pump, (process.stdout, self._out, self._locks[0], prefix)))
            targets.append((_pump, (process.stderr, self._err, self._locks[1], prefix)))
        for target, args in targets:
            thread = threading.Thread(target=target, args=args, name=f"launch-rank{index}", daemon=True)
            thread.start()
            rank.threads.append(thread)

    def _wait_leader(self, rank: _Rank, events: queue.SimpleQueue[tuple[str, int, int]]) -> None:
        # WNOWAIT leaves the leader a zombie: its pid keeps naming our process group until we reap it.
        try:
            info = os.waitid(os.P_PID, rank.process.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None:
            return
        returncode = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        events.put(("exit", rank.index, returncode))  # the queue of this rank's attempt

    def _handle(self, event: tuple[str, int, int]) -> None:
        kind, index, returncode = event
        if kind == "exit":
            self._ranks[index].returncode = returncode

    def _replace(self, index: int, start: Callable[[int], None]) -> None:
        """Reap rank ``index``'s failed process (and what is left of its group), then start a replacement."""
        self._num_replacements += 1
        old = self._ranks[index]
        with self._locks[1]:
            self._err(
                f"paramplane launch: rank {index} {describe_exit(old.returncode or 0)}; starting a replacement "
                f"(replacement {self._num_replacements} of {self.config.max_replacements})\n".encode()
            )
        self._signal_group(old, signal.SIGKILL)
        old.process.wait(timeout=max(self.config.grace_s, 1.0))
        old.reaped = True
        start(index)

    def _supervise(self, replace: Callable[[int], None]) -> tuple[int, str | None]:
        while True:
            if self._signal is not None:
                live = [r for r in self._ranks if r.returncode is None]
                name = signal.Signals(self._signal).name
                return 128 + self._signal, f"received {name}; stopped {_plural(len(live), 'rank')}"
            if all(rank.returncode == 0 for rank in self._ranks):
                return 0, None
            try:
                event = self._events.get(timeout=0.5)
            except queue.Empty:
                continue
            self._handle(event)
            kind, index, returncode = event
            if kind == "exit" and returncode != 0:
                self._report_killed()
            if kind == "exit" and returncode != 0 and self._num_replacements < self.config.max_replacements:
                self._replace(index, replace)
                continue
            if kind == "exit" and returncode != 0:
                num_live = sum(r.returncode is None for r in self._ranks)
                stopped = f"; stopped the other {_plural(num_live, 'rank')}" if num_live else ""
                code = returncode if returncode > 0 else 128 - returncode
                return code, f"rank {index} {describe_exit(returncode)}{stopped}"

    def _report_killed(self) -> None:
        """Tell the agent of every rank killed by a signal (crash, OOM killer, SIGKILL), named lost at once. A
        rank that exited with a code chose to and said why itself (pp.init's hooks abort the world first), or
        failed because of another: a host-mate may see a killed rank's links drop and exit before the killed
        one's own exit event arrives here, so every rank is looked at, not only the one whose event this is."""
        if self._agent is None:
            return
        # A killed process drops its sockets before it is a zombie (tearing down a large one takes a while on
        # busy cores): a host-mate that failed on the dropped links gets this far first, so look a little longer.
        deadline = time.monotonic() + KILLED_GRACE_S
        while True:
            killed = []
            for rank in self._ranks:
                if rank.reaped:
                    continue
                try:
                    info = os.waitid(os.P_PID, rank.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                except ChildProcessError:
                    continue
                if info is not None and info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
                    killed.append((rank.process.pid, describe_exit(-info.si_status)))
            if killed or time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
        for pid, how in killed:
            self._agent.rank_died(pid, how)

    def _stop_all(self, first_signal: int) -> None:
        """Signal every group we started, SIGKILL what is left after the grace, reap the leaders."""
        ranks = [r for r in self._ranks if not r.reaped]
        num_signals = self._num_signals
        for rank in ranks:
            self._signal_group(rank, first_signal)
        deadline = time.monotonic() + self.config.grace_s
        while time.monotonic() < deadline:
            groups = _live_process_groups()
            if groups is None:
                running = any(r.returncode is None for r in ranks)
            else:
                running = any(r.process.pid in groups for r in ranks)
            if not running:
                break
            try:
                event = self._events.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            self._handle(event)
            if self._num_signals > num_signals:
                break  # signalled again while stopping: no more grace
        for rank in ranks:
            self._signal_group(rank, signal.SIGKILL)  # the unreaped leader still holds the group id
        for rank in ranks:
            try:
                rank.process.wait(timeout=max(self.config.grace_s, 1.0))
                rank.reaped = True
            except subprocess.TimeoutExpired:
                with self._locks[1]:
                    self._err(
                        f"paramplane launch: rank {rank.index} (pid {rank.process.pid}) ignores SIGKILL\n".encode()
                    )

    @staticmethod
    def _signal_group(rank: _Rank, signum: int) -> None:
        try:
            os.killpg(rank.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def launch(config: LaunchConfig) -> int:
    """Run one launch to completion and return the exit status (0 when every rank exited 0)."""
    return Launcher(config).run()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paramplane launch",
        description="Start N rank processes of a Python script on this host, like torchrun.",
        usage="paramplane launch -n N (--standalone | --coordinator HOST:PORT | --slurm) [options] "
        "(script.py | -m module | --no-python program) [args ...]",
    )
    add = parser.add_argument
    # Every option sets the LaunchConfig field of its dest; its help is that field's docstring.
    doc = field_docs(LaunchConfig)
    add(
        "-n",
        "--num-ranks",
        type=int,
        metavar="N",
        help=doc["num_ranks"] + " (with --slurm: per node, default 1)",
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--standalone", action="store_true", help=doc["standalone"])
    where.add_argument(
        "--slurm",
        action="store_true",
        help="run as one task of `srun` per node: world size, this node's ranks, the coordinator (hosted by the "
        "first node's launcher) and the token come from the Slurm job (see `paramplane env`)",
    )
    where.add_argument("--coordinator", metavar="HOST:PORT", help=doc["coordinator"])
    add("--world-size", type=int, metavar="W", help=doc["world_size"])
    add("--host-id", metavar="ID", help=doc["host_id"])
    add(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="file holding the job token (default: $PARAMPLANE_TOKEN_FILE, else $PARAMPLANE_TOKEN, "
        "else a random one with --standalone)",
    )
    add("--timeout", dest="timeout_s", type=float, metavar="S", help=doc["timeout_s"])
    add("--join-timeout", dest="join_timeout_s", type=float, metavar="S", help=doc["join_timeout_s"])
    add(
        "--heartbeat-timeout",
        dest="heartbeat_timeout_s",
        type=float,
        metavar="S",
        help=doc["heartbeat_timeout_s"],
    )
    add("--http-port", type=int, metavar="P", help=doc["http_port"])
    grace = default_of(LaunchConfig, "grace_s")
    add(
        "--grace",
        dest="grace_s",
        type=float,
        default=grace,
        metavar="S",
        help=f"{doc['grace_s']} (default {grace})",
    )
    restarts = default_of(LaunchConfig, "max_restarts")
    add("--max-restarts", type=int, default=restarts, metavar="K", help=doc["max_restarts"])
    replacements = default_of(LaunchConfig, "max_replacements")
    add("--max-replacements", type=int, default=replacements, metavar="K", help=doc["max_replacements"])
    add("--no-prefix", dest="prefix", action="store_false", help=doc["prefix"])
    add("--no-agent", dest="agent", action="store_false", help=doc["agent"])
    add("-m", "--module", action="store_true", help=doc["module"])
    add("--no-python", action="store_true", help=doc["no_python"])
    add("target", metavar="script.py", help=doc["target"])
    add("args", nargs=argparse.REMAINDER, help=doc["args"])
    return parser


def main(argv: list[str] | None = None) -> int:
    """``paramplane launch ...``: parse ``argv`` and run the launch; returns the exit status."""
    parser = _parser()
    try:
        options = parser.parse_args(sys.argv[1:] if argv is None else argv)
        token_file = options.token_file
        del options.token_file
        token = read_token(token_file) if token_file is not None else None
        slurm = options.slurm
        del options.slurm
        prefer_control_latency()  # this process runs the host agent (and the coordinator with --coordinator)
        if slurm:
            from paramplane.slurm import slurm_launch

            return slurm_launch({**vars(options), "args": tuple(options.args), "token": token}, launch)
        if options.num_ranks is None:
            parser.error("-n N is required (except with --slurm)")
        config = LaunchConfig(**{**vars(options), "args": tuple(options.args), "token": token})
        return launch(config)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    except ValueError as error:
        print(f"paramplane launch: error: {error}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError, PlaneError) as error:
        print(f"paramplane launch: failed: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
