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
from _netns import bridged_namespaces

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
TLS = yaml.safe_load((REPO / "docker-compose.tls.yml").read_text())


def _interpolate(value: str) -> str:
    """Compose's ``${VAR:-default}`` with no such variable set: the default."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def _command(service: dict[str, Any]) -> list[str]:
    command = service["command"]
    args = shlex.split(command) if isinstance(command, str) else list(command)
    return [_interpolate(a) for a in args]


def _option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


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


def test_compose_nodes_survive_a_killed_host() -> None:
    """What `make test-compose` exercises on the real engine (scripts/compose_test.sh): every service comes
    back after a crash, a node's launcher restarts its ranks into the next epoch, and the coordinator's
    heartbeat timeout is the one the test's bound is built on."""
    services = COMPOSE["services"]
    for name, svc in services.items():
        assert svc["restart"] == "on-failure", name
    for name in ("node-a", "node-b"):
        cmd = _command(services[name])
        assert int(_option(cmd, "--max-restarts")) >= 1, name
        assert "trace:/trace" in services[name]["volumes"], name
        assert services[name]["environment"]["PARAMPLANE_TRACE"].startswith("/trace/"), name
    timeout = int(_option(_command(services["coordinator"]), "--heartbeat-timeout"))
    script = (REPO / "scripts" / "compose_test.sh").read_text()
    assert f"HEARTBEAT_S={timeout} " in script, "compose_test.sh's bound must use the compose file's timeout"
    default = re.search(r"PARAMPLANE_COMPOSE_SCENARIOS:-([\w ]+)\}", script)
    assert default and default.group(1).split() == ["unbroken", "kill_node", "kill_coordinator", "tls"]
    sleeps = [line.strip() for line in script.splitlines() if re.search(r"\bsleep\s+\d", line)]
    assert len(sleeps) == 1 and "poll's period" in sleeps[0], f"waits must poll with a bound: {sleeps}"


def test_tls_overlay_shape() -> None:
    """docker-compose.tls.yml: the coordinator serves TLS with its own certificate, every rank gets the CA and
    its own key (no other service's), and compose.sh makes each file the overlay names."""
    services = TLS["services"]
    coord = _command({"command": services["coordinator"]["command"]})
    assert _command(COMPOSE["services"]["coordinator"]) == coord[: coord.index("--tls-cert")]
    secret_files = {k: v["file"] for k, v in TLS["secrets"].items()}
    assert secret_files[_option(coord, "--tls-cert").split("/")[-1]].endswith("coordinator.pem")
    assert secret_files[_option(coord, "--tls-key").split("/")[-1]].endswith("coordinator.key")
    assert services["coordinator"]["environment"]["PARAMPLANE_TLS_CA"] == "/run/secrets/paramplane_ca"
    for name in ("node-a", "node-b"):
        env, mounted = services[name]["environment"], set(services[name]["secrets"])
        assert {s for s in mounted if s.endswith("_key")} == {name.replace("-", "_") + "_key"}, name
        paths = {
            var: env[f"PARAMPLANE_TLS_{var}"].removeprefix("/run/secrets/") for var in ("CA", "CERT", "KEY")
        }
        assert set(paths.values()) <= mounted, name
        assert secret_files[paths["CERT"]] == f"./.compose/tls/{name}.pem", name
        assert secret_files[paths["KEY"]] == f"./.compose/tls/{name}.key", name
        assert secret_files[paths["CA"]] == "./.compose/tls/ca.pem", name


@pytest.mark.skipif(shutil.which("openssl") is None, reason="compose.sh certs uses openssl")
def test_compose_certs_verify_for_each_service(tmp_path: Path) -> None:
    """`scripts/compose.sh certs` makes what the TLS overlay mounts: each service's certificate verifies
    against the CA, names the service (the address its peers dial), and its key is readable by root only."""
    env = dict(os.environ, PARAMPLANE_TLS_DIR=str(tmp_path))
    made = subprocess.run(
        ["bash", str(REPO / "scripts" / "compose.sh"), "certs"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    for secret in TLS["secrets"].values():
        assert (tmp_path / Path(secret["file"]).name).is_file(), secret
    for name in ("coordinator", "node-a", "node-b"):
        cert = str(tmp_path / f"{name}.pem")
        ok = subprocess.run(
            ["openssl", "verify", "-CAfile", str(tmp_path / "ca.pem"), cert],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert ok.returncode == 0, ok.stdout + ok.stderr
        san = subprocess.run(
            ["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", cert],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        assert f"DNS:{name}" in san, san
        assert (tmp_path / f"{name}.key").stat().st_mode & 0o077 == 0
    other = subprocess.run(  # a certificate of another CA does not verify: the check above can fail
        ["openssl", "verify", "-CAfile", str(tmp_path / "node-a.pem"), str(tmp_path / "node-b.pem")],
        capture_output=True,
        timeout=30,
    )
    assert other.returncode != 0


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


@pytest.fixture
def namespaces() -> Iterator[dict[str, tuple[str, str]]]:
    """service -> (namespace, address), on one bridge; removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for ip netns")
    tag = f"ppc{os.getpid() % 10000}"
    subnet = f"10.215.{random.randrange(1, 250)}"
    spaces = {svc: (f"{tag}{i}", f"{subnet}.{i + 1}") for i, svc in enumerate(COMPOSE["services"])}
    with bridged_namespaces(tag, spaces, {svc: addr for svc, (_, addr) in spaces.items()}):
        yield spaces


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
    paths = {
        "/run/secrets/paramplane_token": str(token),
        "/ckpt": str(ckpt),
        "/trace": str(tmp_path / "trace"),
    }
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
            environment = services[name]["environment"].items()
            env.update({k: _local(["x", _interpolate(str(v))], paths)[1] for k, v in environment})
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
    assert (ckpt / "demo" / "step_60" / "manifest.json").is_file()
    kept = sorted(p.name for p in (ckpt / "demo").iterdir())
    assert kept == ["step_40", "step_60"]  # keep=2 pruned step_20
    assert len(list((tmp_path / "trace" / "demo").glob("rank-*.json"))) == 4  # the trace volume's files
