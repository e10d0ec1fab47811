"""The coordinator's live view (``--http-port``): the page in a real headless browser, ``/metrics`` through the
Prometheus parser, ``/api/status`` against ``paramplane status --json``, and the token rules; on a real
3-rank job (tests/workers/live_job.py) whose rank 2 is stopped with SIGSTOP at the end."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from paramplane import status as status_cli
from paramplane.coordinator.server import CoordinatorConfig, CoordinatorThread

parser = pytest.importorskip("prometheus_client.parser")

REPO = Path(__file__).resolve().parents[2]
TOKEN = "live-view-test-token"
INTERVAL_S = 0.25
STALE_S = max(3 * INTERVAL_S, 1.5)  # the page's threshold (coordinator/page.html: staleAfter)


@dataclass
class Job:
    coordinator: CoordinatorThread
    http: str  # host:port of the view
    address: str  # host:port of the gRPC coordinator
    procs: list[subprocess.Popen[bytes]]
    stop_file: Path


def _get(job: Job, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://{job.http}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _status(job: Job) -> dict[str, Any]:
    code, body = _get(job, "/api/status", {"Authorization": f"Bearer {TOKEN}"})
    assert code == 200, body
    return dict(json.loads(body))


def _wait_for(what: str, check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def job() -> Iterator[Job]:
    config = CoordinatorConfig(
        world_size=3,
        host="127.0.0.1",
        port=0,
        token=TOKEN,
        heartbeat_interval_s=INTERVAL_S,
        heartbeat_timeout_s=120.0,  # the SIGSTOPped rank must stay in the world while the page shows it
        progress_timeout_s=0,
        http_port=0,
    )
    coordinator = CoordinatorThread(config)
    address = coordinator.start()
    assert coordinator.http_address is not None
    scratch = Path(tempfile.mkdtemp(prefix="pp-live-"))
    stop_file = scratch / "stop"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(3):
            env = dict(
                os.environ,
                PARAMPLANE_COORDINATOR=address,
                PARAMPLANE_RANK=str(rank),
                PARAMPLANE_WORLD_SIZE="3",
                PARAMPLANE_TOKEN=TOKEN,
                PARAMPLANE_TEST_STOP=str(stop_file),
                PARAMPLANE_JOIN_TIMEOUT="60",
            )
            log = open(scratch / f"rank-{rank}.log", "wb")  # noqa: SIM115 (the child holds it)
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(REPO / "tests/workers/live_job.py")],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=REPO,
                    start_new_session=True,
                )
            )
            log.close()
        job = Job(coordinator, coordinator.http_address, address, procs, stop_file)

        def reporting() -> bool:
            s = _status(job)
            return s["formed"] and all(int(r["stats"]["step"]) >= 5 for r in s["ranks"])

        _wait_for("the job to form and report steps", reporting)
        yield job
    finally:
        stop_file.touch()
        for proc in procs:
            try:
                os.kill(proc.pid, signal.SIGCONT)  # ours, by PID (the last test stops rank 2)
                proc.wait(30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        coordinator.stop()
        if all(p.returncode == 0 for p in procs):
            shutil.rmtree(scratch, ignore_errors=True)
        else:
            print(f"rank logs in {scratch}")
        assert all(p.returncode == 0 for p in procs), [p.returncode for p in procs]


def _metrics(job: Job) -> dict[str, float]:
    code, body = _get(job, f"/metrics?token={TOKEN}")
    assert code == 200, body
    samples: dict[str, float] = {}
    for family in parser.text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def test_metrics_parse_and_their_counters_move_with_the_job(job: Job) -> None:
    first = _metrics(job)
    assert first["paramplane_world_size{}"] == 3
    assert first["paramplane_ranks_joined{}"] == 3
    assert first["paramplane_world_formed{}"] == 1
    assert {k for k in first if k.startswith("paramplane_heartbeat_age_seconds")} == {
        f"paramplane_heartbeat_age_seconds{{host={socket.gethostname()},rank={r}}}" for r in range(3)
    }
    shm = "paramplane_transport_bytes_total{transport=shm}"
    issued = "paramplane_collectives_issued_total{group=world,rank=1}"
    assert first[shm] > 0 and first[issued] > 0

    def moved() -> bool:
        later = _metrics(job)
        return (
            later[shm] > first[shm]
            and later[issued] > first[issued]
            and later["paramplane_train_tokens_total{}"] > first["paramplane_train_tokens_total{}"]
            and later["paramplane_train_steps_per_second{}"] > 0
        )

    _wait_for("the counters to move", moved, 30)
    assert _metrics(job)["paramplane_aborts_total{}"] == 0


def test_api_status_is_what_paramplane_status_json_prints(job: Job) -> None:
    over_http = _status(job)
    over_grpc = status_cli.fetch(job.address, TOKEN, 10.0)
    assert over_http.keys() == over_grpc.keys()
    for key in ("epoch", "job_id", "world_size", "formed", "aborted"):
        assert over_http[key] == over_grpc[key]
    assert [r["rank"] for r in over_http["ranks"]] == [r["rank"] for r in over_grpc["ranks"]] == [0, 1, 2]
    assert [r["pid"] for r in over_http["ranks"]] == [p.pid for p in job.procs]
    assert over_http["ranks"][0]["stats"]["reported"] is True


def test_a_missing_or_wrong_token_is_refused(job: Job) -> None:
    for path in ("/", "/metrics", "/api/status"):
        assert _get(job, path)[0] == 401
        assert _get(job, path, {"Authorization": "Bearer not-the-token"})[0] == 401
        assert _get(job, f"{path}?token=not-the-token")[0] == 401
        assert _get(job, f"{path}?token={TOKEN}")[0] == 200
    _, body = _get(job, "/")
    assert b"<form" in body  # the page asks for the token
    assert _get(job, "/nothing-here", {"Authorization": f"Bearer {TOKEN}"})[0] == 404


def _raw(job: Job, data: bytes) -> bytes:
    host, port = job.http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_bad_requests_get_4xx_answers(job: Job) -> None:
    assert _raw(job, b"garbage\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert _raw(job, b"POST /api/status HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405 ")
    assert _raw(job, b"GET / HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n").startswith(b"HTTP/1.1 431 ")
    assert _raw(job, b"GET / HTTP/1.1\r\nno colon here\r\n\r\n").startswith(b"HTTP/1.1 400 ")


def test_a_non_loopback_view_needs_a_token() -> None:
    with pytest.raises(ValueError, match="without a token"):
        CoordinatorConfig(world_size=1, http_port=0, http_host="0.0.0.0", http_public=True)
    CoordinatorConfig(world_size=1, http_port=0, http_public=True)  # loopback: allowed


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("no chromium found (as root, `make browser` installs Debian's chromium)")


def _browse(job: Job, *flags: str) -> str:
    with tempfile.TemporaryDirectory(prefix="pp-chromium-") as profile:
        proc = subprocess.run(
            [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             f"--user-data-dir={profile}", "--window-size=1280,900", *flags,
             f"http://{job.http}/?token={TOKEN}"],
            capture_output=True, timeout=90, check=True,
        )  # fmt: skip
    return proc.stdout.decode()


def _rank_rows(dom: str) -> dict[int, str]:
    return {int(m.group(2)): m.group(1) for m in re.finditer(r'<tr class="([^"]*)" data-rank="(\d+)"', dom)}


def test_the_page_in_a_browser_shows_ranks_progress_and_the_stopped_rank(job: Job) -> None:
    browser = _chromium()
    assert browser
    dom = _browse(job, "--dump-dom")
    assert _rank_rows(dom) == {0: "rank", 1: "rank", 2: "rank"}, dom[-3000:]
    assert 'data-group="world"' in dom and ">running<" in dom
    assert re.search(r'<b id="step">\d+</b>', dom) and "<polyline" in dom

    stopped = job.procs[2]
    os.kill(stopped.pid, signal.SIGSTOP)
    try:

        def stuck() -> bool:
            s = _status(job)
            ages = [r["since_heartbeat_s"] for r in s["ranks"]]
            world = next(g for g in s["groups"] if g["group"] == "world")
            return ages[2] > STALE_S + 0.5 and max(ages[:2]) < STALE_S and min(world["unchanged_s"]) > STALE_S

        _wait_for("rank 2's silence to show", stuck, 60)
        dom = _browse(job, "--dump-dom")
        rows = _rank_rows(dom)
        assert rows[2] == "rank stale" and rows[0] == rows[1] == "rank", rows
        assert 'data-behind="2"' in dom, dom[-3000:]
        screenshot = os.environ.get("PARAMPLANE_LIVE_SCREENSHOT")  # docs/live-view.png is made this way
        if screenshot:
            _browse(job, f"--screenshot={Path(screenshot).resolve()}")
    finally:
        os.kill(stopped.pid, signal.SIGCONT)


# -- the bookkeeping behind the view (pure state, fake clock) ---------------------------------------------------
def test_status_counts_aborts_restarts_and_reforms_and_measures_the_training_rate() -> None:
    from paramplane.coordinator.model import Joiner, RankStats
    from paramplane.coordinator.state import CoordinatorState

    s = CoordinatorState(2, new_job_id=lambda: "job")
    first = [Joiner(f"a{r}", "h", f"x:{r}", r, 2, 100 + r) for r in range(2)]
    for r, j in enumerate(first):
        s.join(j, r, 0.0)
    for t in range(11):  # rank 0 reports one step and 10 tokens per second, rank 1 30 tokens per second
        s.heartbeat(1, 1, {}, float(t), RankStats(reported=True, step=t, loss=1.0 / (t + 1), tokens=30 * t))
        s.heartbeat(1, 0, {}, float(t), RankStats(reported=True, step=t, loss=1.0 / (t + 1), tokens=10 * t))
    out = s.status(10.0)
    assert out["steps_per_s"] == pytest.approx(1.0) and out["tokens_per_s"] == pytest.approx(40.0)
    assert [p["step"] for p in out["history"]] == list(range(11))
    assert s.status(25.0)["steps_per_s"] == 0.0  # no report in the last 10 s: stalled
    s.abort(1, 1, "boom")
    # The same processes join again (World.reform): a reform; then new processes after an abort: a restart.
    for r in range(2):
        s.join(Joiner(f"b{r}", "h", f"x:{r}", r, 2, 100 + r), 10 + r, 30.0)
    s.abort(2, 0, "boom again")
    for r in range(2):
        s.join(Joiner(f"c{r}", "h", f"x:{r}", r, 2, 200 + r), 20 + r, 40.0)
    out = s.status(41.0)
    assert (out["num_aborts"], out["num_reforms"], out["num_restarts"], out["epoch"]) == (2, 1, 1, 3)


def test_the_launcher_serves_the_view_of_its_embedded_coordinator(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        "import paramplane as pp\nw = pp.init()\nw.report(step=1, loss=0.5, tokens=8)\nw.barrier()\nw.shutdown()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "paramplane.cli", "launch", "--standalone", "-n", "2", "--http-port", "0",
         str(script)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    found = re.search(
        r"live view on http://127\.0\.0\.1:\d+/ \(the URL with this launch's token is in (\S+)\)", proc.stderr
    )
    assert found, proc.stderr
    assert not Path(found.group(1)).exists()  # the file with the token is gone with the launch
    assert "?token=" not in proc.stderr + proc.stdout  # the made-up token is never printed
