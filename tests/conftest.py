"""Fixtures shared by several test modules."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import paramplane as pp
from paramplane.coordinator.server import CoordinatorConfig, CoordinatorThread


def make_self_signed_cert(folder: Path) -> tuple[Path, Path]:
    """(cert.pem, key.pem) for 127.0.0.1 in ``folder``, its own root (a new CA each call)."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    return cert, key


@pytest.fixture
def self_signed_cert(tmp_path: Path) -> tuple[Path, Path]:
    """(cert.pem, key.pem) for 127.0.0.1, its own root; skips where the openssl command is missing."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    return make_self_signed_cert(tmp_path)


@pytest.fixture(scope="module")
def solo() -> Iterator[pp.World]:
    """A one-rank world on an in-process coordinator (127.0.0.1, port 0), for the rules that need no peers."""
    coord = CoordinatorThread(CoordinatorConfig(world_size=1, host="127.0.0.1", port=0))
    world = pp.init(coord.start(), world_size=1, timeout=10, join_timeout=10)
    try:
        yield world
    finally:
        world.shutdown()
        coord.stop()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Cluster topology tests (a Slurm cluster, the Kubernetes manifests; minutes, root) run only when asked for
    with ``-m cluster`` (``make test-cluster``), not in a plain ``pytest tests``."""
    if "cluster" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="a cluster topology test: make test-cluster (pytest -m cluster) runs it")
    for item in items:
        if item.get_closest_marker("cluster") is not None:
            item.add_marker(skip)
