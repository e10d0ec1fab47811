"""TLS on both planes: the coordinator and the peers serve with a certificate, ranks verify it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paramplane.coordinator.server import CoordinatorConfig, CoordinatorThread

WORKERS = Path(__file__).resolve().parent / "workers"


def test_world_over_tls(tmp_path: Path, self_signed_cert: tuple[Path, Path]) -> None:
    cert, key = self_signed_cert
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
                PARAMPLANE_TIMEOUT="30",
                PARAMPLANE_TLS_CERT=str(cert),
                PARAMPLANE_TLS_KEY=str(key),
                PARAMPLANE_TLS_CA=str(cert),
                PARAMPLANE_TEST_OUT=str(tmp_path),
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKERS / "tls.py")],
                    env=env,
                    cwd=WORKERS,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
            )
        try:
            outputs = [p.communicate(timeout=60)[0].decode(errors="replace") for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait(10)
    for r, p in enumerate(procs):
        assert p.returncode == 0, outputs[r][-3000:]
        result = json.loads((tmp_path / f"rank-{r}.json").read_text())
        assert result["failures"] == [], result["failures"]
        assert result["num_checks"] >= 8


def test_partial_tls_settings_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import paramplane as pp

    monkeypatch.setenv("PARAMPLANE_TLS_CERT", "/nonexistent/cert.pem")
    monkeypatch.delenv("PARAMPLANE_TLS_KEY", raising=False)
    monkeypatch.delenv("PARAMPLANE_TLS_CA", raising=False)
    with pytest.raises(ValueError, match="PARAMPLANE_TLS_KEY"):
        pp.init("127.0.0.1:1")
