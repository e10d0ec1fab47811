"""deploy/kubernetes/: the manifests' shape, and their topology run for real where no cluster is.

The second test runs each pod as processes in a network namespace of its own (one for the coordinator, one per
Job index, on a bridge; the Services' DNS names through ``/etc/netns/<ns>/hosts``), with each container's
command and environment taken from the manifests (``$(VAR)`` references and the completion-index fieldRef
filled in as the kubelet does, ``JOB_COMPLETION_INDEX`` and ``HOSTNAME`` as the Job controller and kubelet set
them, the Secret and the PersistentVolumeClaim mapped to temporary paths). The coordinator's readiness probe
gates the Job, as a rollout would. One pod is killed after the first checkpoint; as the Job controller does
within ``backoffLimit``, every failed pod is replaced by a new one of the same index, and the new world resumes
from the checkpoint. Not run: a real API server, kubelet, cluster DNS or volume driver.
"""

from __future__ import annotations

import os
import random
import re
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
DEPLOY = REPO / "deploy" / "kubernetes"


def _docs() -> list[dict[str, Any]]:
    return [d for p in sorted(DEPLOY.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def _one(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in _docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} manifests"
    return found[0]


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_manifests_shape() -> None:
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in _docs())
    assert kinds == [
        ("Deployment", "paramplane-coordinator"),
        ("Job", "paramplane-train"),
        ("PersistentVolumeClaim", "paramplane-ckpt"),
        ("Secret", "paramplane-token"),
        ("Service", "paramplane-coordinator"),
        ("Service", "paramplane-workers"),
    ]
    deploy = _one("Deployment", "paramplane-coordinator")
    pod = deploy["spec"]["template"]
    assert deploy["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (coord,) = pod["spec"]["containers"]
    port = _flag(coord["command"], "--port")
    world = int(_flag(coord["command"], "--world-size"))
    for probe in ("readinessProbe", "livenessProbe"):
        assert coord[probe]["exec"]["command"] == ["paramplane", "health", f"127.0.0.1:{port}"], probe
    service = _one("Service", "paramplane-coordinator")
    assert service["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]
    lane_port = _flag(coord["command"], "--host-lane-port")  # agents reach the lane at the Service's address
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [int(port), int(lane_port)]
    assert [p["port"] for p in service["spec"]["ports"]] == [int(port), int(lane_port)]

    job = _one("Job", "paramplane-train")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == world
    assert spec["backoffLimit"] >= world, "one lost pod fails every rank of the world: each is replaced"
    template = spec["template"]
    headless = _one("Service", "paramplane-workers")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    assert template["spec"]["subdomain"] == "paramplane-workers"
    (rank,) = template["spec"]["containers"]
    env = _env(rank)
    assert env["PARAMPLANE_COORDINATOR"] == f"paramplane-coordinator:{port}"
    assert int(env["PARAMPLANE_WORLD_SIZE"]) == world
    assert env["PARAMPLANE_ADVERTISE"] == "paramplane-train-$(POD_INDEX).paramplane-workers"
    annotation = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert env["POD_INDEX"]["fieldRef"]["fieldPath"] == annotation
    ckpt = _flag(rank["command"], "--ckpt")
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in rank["volumeMounts"]}
    assert volumes[mounts[ckpt]]["persistentVolumeClaim"]["claimName"] == "paramplane-ckpt"
    for container, pod_spec in ((rank, template["spec"]), (coord, pod["spec"])):
        assert not any(
            "TOKEN" in e["name"] and "value" in e and "FILE" not in e["name"]
            for e in container.get("env", [])
        )
        secret_mounts = [m for m in container["volumeMounts"] if m["name"] == "token"]
        token_volume = {v["name"]: v for v in pod_spec["volumes"]}["token"]
        assert token_volume["secret"]["secretName"] == "paramplane-token" and secret_mounts
    assert env["PARAMPLANE_TOKEN_FILE"] == f"{secret_mounts[0]['mountPath']}/token"
    assert _flag(coord["command"], "--token-file") == env["PARAMPLANE_TOKEN_FILE"]
    assert "token" in _one("Secret", "paramplane-token")["stringData"]


@pytest.fixture
def pods() -> Iterator[dict[str, tuple[str, str]]]:
    """pod -> (namespace, address) for the coordinator and each Job index, on one bridge; removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for ip netns")
    world = _one("Job", "paramplane-train")["spec"]["completions"]
    tag = f"ppk{os.getpid() % 10000}"
    subnet = f"10.214.{random.randrange(1, 250)}"
    names = ["coordinator", *(f"paramplane-train-{i}" for i in range(world))]
    spaces = {name: (f"{tag}{i}", f"{subnet}.{i + 1}") for i, name in enumerate(names)}
    dns = {"paramplane-coordinator": spaces["coordinator"][1]}  # the Service (one ready endpoint)
    for i in range(world):  # the headless Service's per-pod names, and each pod's own hostname
        addr = spaces[f"paramplane-train-{i}"][1]
        dns |= {f"paramplane-train-{i}.paramplane-workers": addr, f"paramplane-train-{i}": addr}
    with bridged_namespaces(tag, spaces, dns):
        yield spaces


def _local(args: list[str], paths: dict[str, str]) -> list[str]:
    """A container's command as this machine runs it: our interpreter, mounted paths mapped."""
    head = {"paramplane": [sys.executable, "-m", "paramplane.cli"], "python": [sys.executable]}[args[0]]
    return head + [_map(a, paths) for a in args[1:]]


def _map(value: str, paths: dict[str, str]) -> str:
    for inside, outside in paths.items():
        value = value.replace(inside, outside)
    return value


def _container_env(container: dict[str, Any], index: int, paths: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet builds it for Job index ``index``."""
    env = {"JOB_COMPLETION_INDEX": str(index), "HOSTNAME": f"paramplane-train-{index}"}
    for item in container["env"]:
        if "valueFrom" in item:
            assert "job-completion-index" in item["valueFrom"]["fieldRef"]["fieldPath"]
            env[item["name"]] = str(index)
        else:  # $(NAME) expands variables defined before it
            env[item["name"]] = re.sub(
                r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), item["value"]
            )
    return {k: _map(v, paths) for k, v in env.items()}


class Pod:
    def __init__(self, ns: str, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, *argv],
            env=env,
            cwd=REPO,  # the image's /app holds examples/ like the repository
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.mark.timeout(300)  # its own bounds below
@pytest.mark.netns
@pytest.mark.cluster  # about 70 s (a lost pod is noticed after the coordinator's 30 s heartbeat timeout): make test-cluster
def test_kubernetes_topology_resumes_after_a_lost_pod(
    tmp_path: Path, pods: dict[str, tuple[str, str]]
) -> None:
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "token").write_text(os.urandom(16).hex())
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    paths = {"/run/secrets/paramplane": str(secret), "/ckpt": str(ckpt)}
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PARAMPLANE_", "SLURM_", "OMPI_"))}
    base |= {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    (coord,) = _one("Deployment", "paramplane-coordinator")["spec"]["template"]["spec"]["containers"]
    job = _one("Job", "paramplane-train")["spec"]
    (rank,) = job["template"]["spec"]["containers"]
    # The first run stalls after its first checkpoint (tests/workers/stall_train.py wraps the manifest's script).
    command = list(rank["command"])
    assert command[1] == "examples/train_multinode.py"
    command[1:2] = ["tests/workers/stall_train.py", "--stall-watch"]
    running: dict[str, Pod] = {}
    outputs: list[str] = []
    try:
        running["coordinator"] = Pod(pods["coordinator"][0], _local(coord["command"], paths), base)
        probe = coord["readinessProbe"]
        deadline = time.monotonic() + 60
        while True:  # the rollout: the Job starts once the coordinator is ready
            result = subprocess.run(
                ["ip", "netns", "exec", pods["coordinator"][0], *_local(probe["exec"]["command"], paths)],
                capture_output=True,
                env=base,
                timeout=30,
            )
            if result.returncode == 0:
                break
            assert time.monotonic() < deadline, "the coordinator never became ready"
            time.sleep(float(probe["periodSeconds"]))

        def start(index: int) -> None:
            env = base | _container_env(rank, index, paths)
            running[f"paramplane-train-{index}"] = Pod(
                pods[f"paramplane-train-{index}"][0], _local(command, paths), env
            )

        world = job["completions"]
        for index in range(world):
            start(index)
        deadline = time.monotonic() + 120
        while not (ckpt / "step_20" / "manifest.json").is_file():
            assert time.monotonic() < deadline, "no first checkpoint"
            time.sleep(0.2)
        running[f"paramplane-train-{world - 1}"].kill()  # a pod lost mid-run (its node went away)
        failures, done = 1, set()
        start(world - 1)  # the Job controller replaces it (same index)
        deadline = time.monotonic() + 200
        while len(done) < world:
            assert time.monotonic() < deadline, "the Job did not complete"
            for index in range(world):
                pod = running[f"paramplane-train-{index}"]
                if index in done or pod.proc.poll() is None:
                    continue
                out = pod.proc.stdout.read() if pod.proc.stdout else ""
                outputs.append(f"--- pod {index} (exit {pod.proc.returncode})\n{out}")
                if pod.proc.returncode == 0:
                    done.add(index)
                    continue
                failures += 1
                assert failures <= job["backoffLimit"], "backoffLimit reached:\n" + "\n".join(outputs)[-6000:]
                start(index)
            time.sleep(0.2)
    finally:
        for pod in running.values():
            pod.kill()
    text = "\n".join(outputs)
    assert f"resumed from {ckpt}/step_20 at step 20" in text, text[-6000:]
    assert f"hosts {world}, ranks {world}, shard group 1" in text, text[-6000:]
    assert (ckpt / "step_60" / "manifest.json").is_file()
    assert failures >= 2, "the lost pod's peers must fail too (and be replaced) rather than hang"
    assert shlex.join(rank["command"]).endswith("--steps 60")
