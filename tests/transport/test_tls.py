"""TLS on both planes: the coordinator and the peers serve with a certificate, ranks verify it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import make_self_signed_cert

from paramplane.coordinator.server import CoordinatorConfig, CoordinatorThread

WORKERS = Path(__file__).resolve().parents[1] / "workers"


def _tls_world(
    tmp_path: Path, certs: list[tuple[Path, Path]], ca: Path, args: list[str], timeout: str = "30"
) -> list[tuple[int | None, str, dict[str, Any]]]:
    """Two ranks, rank r serving with ``certs[r]`` and trusting ``ca`` (the coordinator serves with
    ``certs[0]``); each rank's (exit status, output, report)."""
    cert, key = certs[0]
    config = CoordinatorConfig(
        host="127.0.0.1", port=0, world_size=2, tls_cert=cert.read_bytes(), tls_key=key.read_bytes()
    )
    with CoordinatorThread(config) as coordinator:
        procs = []
        for r in range(2):
            env = dict(
                os.environ,
                PARAMPLANE_COORDINATOR=coordinator.address,
                PARAMPLANE_RANK=str(r),
                PARAMPLANE_WORLD_SIZE="2",
                PARAMPLANE_TRANSPORT="grpc",
                PARAMPLANE_TIMEOUT=timeout,
                PARAMPLANE_TLS_CERT=str(certs[r][0]),
                PARAMPLANE_TLS_KEY=str(certs[r][1]),
                PARAMPLANE_TLS_CA=str(ca),
                PARAMPLANE_TEST_OUT=str(tmp_path),
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKERS / "tls.py"), *args],
                    env=env,
                    cwd=WORKERS,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
            )
        try:
            outputs = [p.communicate(timeout=90)[0].decode(errors="replace") for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait(10)
    return [
        (p.returncode, outputs[r], json.loads((tmp_path / f"rank-{r}.json").read_text()))
        for r, p in enumerate(procs)
    ]


def test_world_over_tls(tmp_path: Path, self_signed_cert: tuple[Path, Path]) -> None:
    """Collectives and point-to-point over TLS ride gRPC streams (no lane is served or opened), and a
    plaintext call to a peer is refused."""
    for code, output, result in _tls_world(tmp_path, [self_signed_cert] * 2, self_signed_cert[0], []):
        assert code == 0, output[-3000:]
        assert result["failures"] == [], result["failures"]
        assert result["num_checks"] >= 11


def test_a_peer_certified_by_another_ca_is_refused(
    tmp_path: Path, self_signed_cert: tuple[Path, Path]
) -> None:
    """Rank 1 serves with a certificate from a CA the world does not trust: rank 0 will not send to it, and
    the collective fails with a PlaneError on both ranks within the timeout instead of hanging or falling back
    to plaintext."""
    other = tmp_path / "other"
    other.mkdir()
    stranger = make_self_signed_cert(other)
    ranks = _tls_world(
        tmp_path, [self_signed_cert, stranger], self_signed_cert[0], ["other_ca"], timeout="10"
    )
    for code, output, result in ranks:
        assert code == 0, output[-3000:]
        assert result["failures"] == [] and result["num_checks"] == 1, result
        assert result["values"]["error"], result
    refused = ranks[0][2]["values"]  # the rank that dialled the stranger says why, at once
    assert refused["error"] == "AuthError", refused
    assert "rank 1" in refused["message"] and "PARAMPLANE_TLS_CA" in refused["message"], refused


def test_partial_tls_settings_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import paramplane as pp

    monkeypatch.setenv("PARAMPLANE_TLS_CERT", "/nonexistent/cert.pem")
    monkeypatch.delenv("PARAMPLANE_TLS_KEY", raising=False)
    monkeypatch.delenv("PARAMPLANE_TLS_CA", raising=False)
    with pytest.raises(ValueError, match="PARAMPLANE_TLS_KEY"):
        pp.init("127.0.0.1:1")
