"""A zygote for rank workers: what they import imported once, each rank forked from it.

A torch worker spends seconds importing torch and transformers before it does anything, and the torch tests
start about two hundred of them on two cores; a numpy worker spends ~0.3 s importing numpy, gRPC and paramplane,
and most other tests start two to four of them. ``Zygote`` starts this file as a process that imports them once
(``_preload``: with torch and transformers for a worker that imports torch, without for the others) and then
forks one child per request; the child takes the requester's environment, working
directory, argv and stdout/stderr and runs the worker script as ``__main__`` (``runpy``), so the worker runs as
it would have after ``python worker.py``. The requester is ``_zygote_client.py``, the process the harness
started as the rank: it relays signals and exits as the child did, and when it dies the zygote kills the
child's process group, so the harness's PID-based kills and exit codes keep their meaning (a signal it cannot
relay, SIGSTOP, stops only the requester: a test that stops a rank starts the rank itself).

Forking is only safe from a process with one thread: the zygote refuses to serve (``Zygote.command`` then says
no and the harness execs the worker as usual) when its imports left other threads running, which happens when
the libraries may use more than one intra-op thread (OpenMP's and OpenBLAS's pools start at import). Children
get the zygote's thread settings, so only ranks whose thread and gRPC variables equal the zygote's use it.
``PARAMPLANE_TEST_ZYGOTE=0`` turns it off.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKERS = HERE / "workers"
EXAMPLES = HERE.parent / "examples"
CLIENT = HERE / "_zygote_client.py"
INHERITED_AT_IMPORT = re.compile(r"(OMP|OPENBLAS|MKL)_NUM_THREADS|GRPC_.*|PYTHON.*")
"""Variables the libraries read when they are imported: a child keeps the zygote's, so a rank whose values
differ is exec'd instead."""
_TORCH_IMPORT = re.compile(rb"^\s*(import torch|from torch|import _torch_models|from _torch_models)", re.M)
_MAX_REQUEST = 1 << 24
_FAMILIES = ("GPT2", "Llama", "Mistral", "Qwen2", "ResNet", "Bert", "T5", "Mixtral", "GPTNeoX")
"""The transformers model families the workers build (``_torch_models``)."""
_CLASSES = ("Config", "ForCausalLM", "LMHeadModel", "ForImageClassification", "ForMaskedLM", "Model")


def _preload(torch: bool) -> None:
    """Import what the workers import (nothing here runs a torch operation or starts a thread); without
    ``torch``, what the numpy workers import: paramplane's modules that do not import torch."""
    import importlib
    import pkgutil

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    sys.path.insert(1, str(WORKERS))
    import numpy  # noqa: F401

    if torch:
        import torch as _torch  # noqa: F401

    import paramplane

    for info in pkgutil.walk_packages(paramplane.__path__, "paramplane."):
        if ".cli" in info.name or info.name.endswith("__main__"):
            continue
        if not torch and "torch" in info.name:
            continue
        try:
            importlib.import_module(info.name)
        except ImportError:  # the gpu extra's modules without cupy
            pass
    import _common  # noqa: F401

    if not torch:
        return
    import _torch_models as tm
    import transformers

    for name in dir(transformers):  # its lazy module imports a model's code on first access
        if name.startswith(_FAMILIES) and name.endswith(_CLASSES):
            getattr(transformers, name)
    if "resnet18" in tm.MODELS:
        tm.torchvision_models()
    if "vit" in tm.MODELS:
        tm.timm_module()


def _recv_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    conn.settimeout(10.0)
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 2)
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        more = conn.recv(1 << 16)
        if not more or len(data) > _MAX_REQUEST:
            raise ConnectionError("truncated request")
        data += more
    conn.settimeout(None)
    (length,) = struct.unpack("!I", data[:4])
    return json.loads(data[4 : 4 + length]), fds


def _serve(listener: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """Fork a child per request until stdin closes; returns (in the child only) the request it runs."""
    waiting: set[socket.socket] = set()
    running: dict[socket.socket, int] = {}  # connection -> child pid
    orphans: set[socket.socket] = set()  # connections whose requester died: their child is being killed
    drains: list[socket.socket] = []  # requesters waiting for every orphan to be gone

    def orphan_dead_requesters() -> None:
        gone, _, _ = select.select(list(set(running) - orphans), [], [], 0)
        for conn in gone:
            if not conn.recv(1):
                _kill_group(running[conn])
                orphans.add(conn)

    pidfds: dict[int, socket.socket] = {}  # pidfd -> connection
    while True:
        readable, _, _ = select.select(
            [listener, sys.stdin, *waiting, *(set(running) - orphans), *pidfds], [], []
        )
        for ready in readable:
            if ready is sys.stdin:  # the harness is gone or done: so are the ranks it started
                for pid in running.values():
                    _kill_group(pid)
                os._exit(0)
            if ready is listener:
                waiting.add(listener.accept()[0])
            elif isinstance(ready, int):  # a child exited
                conn = pidfds.pop(ready)
                os.close(ready)
                pid = running.pop(conn)
                orphans.discard(conn)
                _kill_group(pid)  # what it left behind in its group (it is a zombie: the id is still its own)
                _, status = os.waitpid(pid, 0)
                _reply(conn, {"status": status})
                conn.close()
                if not orphans:
                    for drain in drains:
                        _reply(drain, {"drained": True})
                        drain.close()
                    drains.clear()
            elif ready in waiting:
                waiting.discard(ready)
                try:
                    request, fds = _recv_request(ready)
                except (OSError, ValueError) as exc:
                    print(f"zygote: bad request: {exc!r}", file=sys.stderr, flush=True)
                    ready.close()
                    continue
                if request.get("drain"):
                    orphan_dead_requesters()
                    if orphans:
                        drains.append(ready)
                    else:
                        _reply(ready, {"drained": True})
                        ready.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for conn in [*waiting, *running, *drains, ready]:
                        conn.close()
                    for fd in pidfds:
                        os.close(fd)
                    return request, fds
                for fd in fds:
                    os.close(fd)
                running[ready] = pid
                pidfds[os.pidfd_open(pid)] = ready
                _reply(ready, {"pid": pid})
            else:  # a requester closed its end while its child runs: it was killed
                orphan_dead_requesters()


def _reply(conn: socket.socket, message: Mapping[str, Any]) -> None:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:  # the requester is gone
        pass


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _run(request: Mapping[str, Any], fds: Sequence[int]) -> None:
    """In the child: become the rank the requester stands for and run its script as ``__main__``."""
    import runpy

    import numpy as np

    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for target, fd in zip((1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    np.random.seed()  # a fresh process's global generator is seeded from entropy; the zygote's is shared
    script = os.path.abspath(request["argv"][0])
    sys.argv = [script, *request["argv"][1:]]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


def main() -> None:
    path = sys.argv[1]
    _preload(torch="--numpy" not in sys.argv[2:])
    threads = len(os.listdir("/proc/self/task"))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print(json.dumps({"threads": threads}), flush=True)
    if threads != 1:
        return
    request, fds = _serve(listener)
    _run(request, fds)


class Zygote:
    """One zygote process (started by ``start``), serving ranks whose import-time variables equal ``env``'s."""

    def __init__(self, env: Mapping[str, str], torch: bool = True) -> None:
        self.torch = torch
        self.env = {
            **env,
            "PYTHONUNBUFFERED": "1",
            "GRPC_ENABLE_FORK_SUPPORT": env.get("GRPC_ENABLE_FORK_SUPPORT", "0"),
        }
        self._dir = tempfile.TemporaryDirectory(prefix="pp-zygote-")
        self.socket = os.path.join(self._dir.name, "zygote.sock")
        self.proc: subprocess.Popen[bytes] | None = None
        self.ok = False
        self.stamp = _source_stamp()

    def start(self, timeout: float = 120.0) -> bool:
        """Start the process and wait for it to import; whether it serves."""
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__)), self.socket, *([] if self.torch else ["--numpy"])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.env,
            cwd=HERE.parent,
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        self.ok = bool(line) and json.loads(line).get("threads") == 1
        if not self.ok:
            self.close()
        return self.ok

    def serves(self, rank_env: Mapping[str, str]) -> bool:
        """Whether a rank with environment ``rank_env`` may be forked from this zygote."""
        keys = {k for k in (*self.env, *rank_env) if INHERITED_AT_IMPORT.fullmatch(k)}
        return all(self.env.get(k) == rank_env.get(k) for k in keys)

    def command(self, script: Path, args: Sequence[str]) -> list[str]:
        return [sys.executable, "-S", str(CLIENT), self.socket, str(script), *args]

    def drain(self, timeout: float = 30.0) -> None:
        """Return once every child whose requester died is gone (they are killed when it dies): after the
        harness killed a world's ranks, nothing of theirs is left."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout)
            conn.connect(self.socket)
            request = json.dumps({"drain": True}).encode()
            conn.sendall(struct.pack("!I", len(request)) + request)
            if not conn.makefile("rb").readline():
                raise RuntimeError("the test zygote went away")

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._dir.cleanup()


_ZYGOTES: dict[tuple[bool, tuple[tuple[str, str], ...]], Zygote | None] = {}
_SOURCES = ("client", "node", "coordinator", "tests/workers")
"""What a zygote imports from this repository: edited after it started (a developer's edit between two tests of
one session), the zygote is stale and a fresh one starts, as a fresh rank would import the new code."""


def _source_stamp() -> tuple[float, int]:
    times = [p.stat().st_mtime for folder in _SOURCES for p in (HERE.parent / folder).rglob("*.py")]
    return max(times, default=0.0), len(times)


def for_rank(script: Path, env: Mapping[str, str]) -> Zygote | None:
    """A serving zygote for the worker (or example) ``script`` run with ``env``, or None (then exec it): one
    that imported torch and transformers for a script that imports torch, else one that imported numpy and
    paramplane."""
    if os.environ.get("PARAMPLANE_TEST_ZYGOTE", "1") == "0":
        return None
    if not (script.is_relative_to(WORKERS) or script.is_relative_to(EXAMPLES)):
        return None
    torch = bool(_TORCH_IMPORT.search(script.read_bytes()))
    key = (torch, tuple(sorted((k, v) for k, v in env.items() if INHERITED_AT_IMPORT.fullmatch(k))))
    stale = _ZYGOTES.get(key)
    if stale is not None and stale.stamp != _source_stamp():
        stale.close()
        del _ZYGOTES[key]
    if key not in _ZYGOTES:
        zygote = Zygote(env, torch)
        _ZYGOTES[key] = zygote if zygote.start() else None
        if _ZYGOTES[key] is not None:
            atexit.register(zygote.close)
    zygote = _ZYGOTES[key]
    return zygote if zygote is not None and zygote.serves(env) else None


if __name__ == "__main__":
    main()
