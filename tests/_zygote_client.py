"""A rank process that asks the test zygote (``tests/_zygote.py``) to fork the real one, then stands in for it.

``python -S _zygote_client.py SOCKET SCRIPT ARGS...`` sends its argv, environment, working directory and its
stdout/stderr descriptors to the zygote, forwards SIGINT/SIGTERM/SIGHUP to the forked rank, and exits as the
rank exited (the same code, or killed by the same signal). Killed itself, its connection closes and the zygote
kills the rank's process group. Standard library only: it starts in milliseconds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys


def main() -> None:
    path, script, *args = sys.argv[1:]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    request = json.dumps({"argv": [script, *args], "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(conn, [struct.pack("!I", len(request)) + request], [1, 2])
    reader = conn.makefile("rb")
    started = json.loads(reader.readline())
    pid = started["pid"]

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, forward)
    line = reader.readline()
    if not line:
        sys.stderr.write("paramplane test zygote: the zygote went away before the rank exited\n")
        os._exit(70)
    status = json.loads(line)["status"]
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
