"""The top-level docker-compose.yml, checked where docker is not: its shape, and its topology for real.

The second test brings the compose topology up as network namespaces: one per service, joined by a
bridge, service names resolved through ``/etc/netns/<ns>/hosts``, each service's own command and
environment (the secret file and the volume mapped to temporary paths), the coordinator's healthcheck
honoured before the nodes start, as compose does. It asserts the training result and the checkpoint.
"""

from __future__ import annotations

import os
import random
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())


def _command(service: dict[str, Any]) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else list(command)


def test_compose_file_shape() -> None:
    services = COMPOSE["services"]
    assert set(services) == {"coordinator", "node-a", "node-b"}
    assert "paramplane_token" in COMPOSE["secrets"] and "file" in COMPOSE["secrets"]["paramplane_token"]
    for name, svc in services.items():
        env = svc.get("environment", {})
        assert "PARAMPLANE_TOKEN" not in env, f"{name}: the token must come from the secret file"
        assert "paramplane_token" in svc["secrets"], name
        assert _command(svc)[0] == "paramplane", name
    health = services["coordinator"]["healthcheck"]["test"]
    assert health[1:3] == ["paramplane", "health"]
    coord = _command(services["coordinator"])
    world = int(coord[coord.index("--world-size") + 1])
    ranks = 0
    for name in ("node-a", "node-b"):
        svc = services[name]
        assert svc["depends_on"]["coordinator"]["condition"] == "service_healthy"
        cmd = _command(svc)
        assert cmd[1] == "launch" and int(cmd[cmd.index("--world-size") + 1]) == world
        ranks += int(cmd[cmd.index("-n") + 1])
        assert svc["environment"]["PARAMPLANE_ADVERTISE"] == name  # peers dial the service name
        assert "ckpt:/ckpt" in svc["volumes"]
    assert ranks == world, "the nodes' ranks must fill the coordinator's world"
    assert (REPO / "Dockerfile").read_text().count("ARG BASE=") == 1


def test_gpu_compose_overlay_shape() -> None:
    """docker-compose.gpu.yml overlays the base file: the image installs the gpu extra (the Dockerfile's
    EXTRAS argument), every node reserves the NVIDIA devices, and the command its header names to prepare the
    wheels exists (scripts/compose.sh wheels --gpu)."""
    text = (REPO / "docker-compose.gpu.yml").read_text()
    gpu = yaml.safe_load(text)
    assert set(gpu["services"]) <= set(COMPOSE["services"])
    assert gpu["services"]["coordinator"]["build"]["args"]["EXTRAS"] == "[gpu]"
    assert "paramplane${EXTRAS}" in (REPO / "Dockerfile").read_text()
    for name in ("node-a", "node-b"):
        devices = gpu["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}], name
    documented = re.search(r"scripts/compose\.sh (\w+) (--\w+)", text)
    assert documented is not None, "the overlay's header names no preparation command"
    mode, flag = documented.groups()
    script = (REPO / "scripts" / "compose.sh").read_text()
    assert re.search(rf"^\s*{mode}\|.*\)|\|{mode}\)", script, re.M), f"compose.sh has no {mode!r} mode"
    assert f'"{flag}"' in script, f"compose.sh {mode} does not take {flag}"
    refused = subprocess.run(
        ["bash", str(REPO / "scripts" / "compose.sh"), "no-such-mode"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert refused.returncode == 2 and mode in refused.stderr, refused.stderr


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def namespaces() -> Iterator[dict[str, tuple[str, str]]]:
    """service -> (namespace, address), on one bridge; removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for ip netns")
    tag = f"ppc{os.getpid() % 10000}"
    subnet = f"10.215.{random.randrange(1, 250)}"
    names = list(COMPOSE["services"])
    spaces = {svc: (f"{tag}{i}", f"{subnet}.{i + 1}") for i, svc in enumerate(names)}
    bridge_ns = f"{tag}br"
    made: list[str] = []
    try:
        for ns in [bridge_ns, *(ns for ns, _ in spaces.values())]:
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("-n", bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge_ns, "link", "set", "br0", "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{addr} {svc}\n" for svc, (_, addr) in spaces.items())
        for i, (ns, addr) in enumerate(spaces.values()):
            _ip("link", "add", f"{tag}v{i}", "type", "veth", "peer", "name", f"{tag}p{i}")
            _ip("link", "set", f"{tag}v{i}", "netns", ns)
            _ip("link", "set", f"{tag}p{i}", "netns", bridge_ns)
            _ip("-n", bridge_ns, "link", "set", f"{tag}p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", f"{tag}v{i}")
            _ip("-n", ns, "link", "set", f"{tag}v{i}", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
    except (subprocess.CalledProcessError, OSError) as exc:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        pytest.skip(f"ip netns unavailable here: {exc}")
    try:
        yield spaces
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


def _local(args: list[str], paths: dict[str, str]) -> list[str]:
    """A service's command as this machine runs it: our interpreter, container paths mapped."""
    out = [sys.executable, "-m", "paramplane.cli"] if args[0] == "paramplane" else [args[0]]
    for a in args[1:]:
        for inside, outside in paths.items():
            a = a.replace(inside, outside)
        out.append(a)
    return out


def _start(ns: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, *args],
        env=env,
        cwd=REPO,  # the image's /app holds examples/ like the repository
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


@pytest.mark.timeout(330)  # its own bounds (270 s), not the global 120 s
@pytest.mark.netns
def test_compose_topology_trains_across_namespaces(
    tmp_path: Path, namespaces: dict[str, tuple[str, str]]
) -> None:
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(16))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    paths = {"/run/secrets/paramplane_token": str(token), "/ckpt": str(ckpt)}
    base = {k: v for k, v in os.environ.items() if not k.startswith("PARAMPLANE_")}
    base["PYTHONUNBUFFERED"] = "1"
    services = COMPOSE["services"]
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        coord_ns = namespaces["coordinator"][0]
        procs["coordinator"] = _start(coord_ns, _local(_command(services["coordinator"]), paths), base)
        check = services["coordinator"]["healthcheck"]
        probe = _local(check["test"][1:], paths)
        healthy = False
        for _ in range(int(check["retries"])):  # compose's healthcheck loop: bounded by its retries
            result = subprocess.run(
                ["ip", "netns", "exec", coord_ns, *probe], capture_output=True, env=base, timeout=30
            )
            if result.returncode == 0:
                healthy = True
                break
            time.sleep(float(str(check["interval"]).rstrip("s")))
        assert healthy, "the coordinator never became healthy"
        for name in ("node-a", "node-b"):
            env = dict(base)
            env.update({k: _local(["x", str(v)], paths)[1] for k, v in services[name]["environment"].items()})
            procs[name] = _start(namespaces[name][0], _local(_command(services[name]), paths), env)
        outputs = {}
        for name in ("node-a", "node-b"):
            out, _ = procs[name].communicate(timeout=240)
            outputs[name] = out
            assert procs[name].returncode == 0, f"{name} failed:\n{out[-4000:]}"
    finally:
        for proc in procs.values():
            _stop(proc)
    text = "\n".join(outputs.values())
    assert "hosts 2, ranks 4, shard group 2" in text, text[-3000:]
    match = re.search(r"final loss: ([\d.]+); accuracy: ([\d.]+)", text)
    assert match and float(match.group(2)) > 0.9, text[-3000:]
    assert (ckpt / "step_60" / "manifest.json").is_file()
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_40", "step_60"]  # keep=2 pruned step_20
