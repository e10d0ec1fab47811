"""Network namespaces on one bridge, for the deploy topology tests (root and iproute2; the test skips otherwise)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import pytest


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@contextmanager
def bridged_namespaces(
    tag: str, spaces: Mapping[str, tuple[str, str]], hosts: Mapping[str, str]
) -> Iterator[list[str]]:
    """A namespace per entry of ``spaces`` (name -> (namespace, address in a /24)), all on a bridge in the
    namespace ``<tag>br``, each with an /etc/netns hosts file naming ``hosts`` (name -> address). Skips the test
    where they cannot be made; on exit kills what still runs inside them (only this test started anything
    there) and deletes them. Yields the namespaces made."""
    made: list[str] = []
    bridge = f"{tag}br"
    hosts_file = "127.0.0.1 localhost\n" + "".join(f"{addr} {name}\n" for name, addr in hosts.items())
    try:
        try:
            for ns in [bridge, *(ns for ns, _ in spaces.values())]:
                ip("netns", "add", ns)
                made.append(ns)
            ip("-n", bridge, "link", "add", "br0", "type", "bridge")
            ip("-n", bridge, "link", "set", "br0", "up")
            for i, (ns, addr) in enumerate(spaces.values()):
                ip("link", "add", f"{tag}v{i}", "type", "veth", "peer", "name", f"{tag}p{i}")
                ip("link", "set", f"{tag}v{i}", "netns", ns)
                ip("link", "set", f"{tag}p{i}", "netns", bridge)
                ip("-n", bridge, "link", "set", f"{tag}p{i}", "master", "br0", "up")
                ip("-n", ns, "addr", "add", f"{addr}/24", "dev", f"{tag}v{i}")
                ip("-n", ns, "link", "set", f"{tag}v{i}", "up")
                ip("-n", ns, "link", "set", "lo", "up")
                etc = Path("/etc/netns") / ns
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(hosts_file)
        except (subprocess.CalledProcessError, OSError) as exc:
            pytest.skip(f"ip netns unavailable here: {exc}")
        yield made
    finally:
        for ns in made:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10)
            for pid in pids.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
