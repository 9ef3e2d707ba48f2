"""A password given in --dsn does not stay in the process list: /proc/PID/cmdline, which ps
shows to every user of the host, no longer holds it once the relay has started."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

WORD = f"hunter2-{uuid.uuid4().hex[:8]}"  # the password, and nothing else has it


def test_a_password_in_dsn_is_gone_from_proc_cmdline(tmp_path: Path) -> None:
    if not Path("/proc/self/cmdline").exists():
        pytest.skip("no /proc")
    # A "server" that takes the connection and never answers: the relay waits in its first
    # connection attempt until connect_timeout, alive and already past start-up's rewrite.
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(60)
        port = server.getsockname()[1]
        dsn = (
            f"host=127.0.0.1 port={port} user=relay dbname=shop password={WORD} "
            "connect_timeout=30 sslmode=disable gssencmode=disable"
        )
        with subprocess.Popen(
            [sys.executable, "-m", "cdc_relay", "stream", "--dsn", dsn],
            env={
                "CDC_RELAY_KAFKA_BOOTSTRAP": "127.0.0.1:1",
                "PATH": "/usr/bin:/bin",
                "HOME": str(tmp_path),
            },
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as relay:
            try:
                connection, _ = server.accept()  # the relay is connecting: start-up is over
                with connection:
                    cmdline = Path(f"/proc/{relay.pid}/cmdline").read_bytes()
                    comm = Path(f"/proc/{relay.pid}/comm").read_text().strip()
                    ps = subprocess.run(  # -ww: a ps without a terminal cuts at 80 columns
                        ["ps", "-ww", "-o", "args=", "-p", str(relay.pid)],
                        capture_output=True,
                        text=True,
                        check=False,
                    ).stdout
            finally:
                relay.kill()
                _, stderr = relay.communicate(timeout=30)
    assert WORD.encode() not in cmdline
    assert b"cdc_relay stream --dsn " in cmdline
    assert b"password=***" in cmdline
    assert WORD not in ps
    assert Path(sys.executable).name.startswith(comm)  # the short name pgrep and top show
    assert "password=***" in ps or not ps  # ps may be missing on a slim machine
    assert stderr.startswith("cdc-relay: warning: a password in --dsn"), stderr
    assert WORD not in stderr


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM (its SigCgt mask, bit 15)."""
    status = Path(f"/proc/{pid}/status").read_text()
    (mask,) = [line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")]
    return bool(int(mask, 16) & (1 << (signal.SIGTERM - 1)))


@pytest.mark.parametrize("command", ["stream", "poll"])
def test_a_sigterm_during_start_up_stops_the_relay_cleanly(tmp_path: Path, command: str) -> None:
    """SIGTERM while the relay still imports its libraries: exit 0, nothing relayed."""
    if not Path("/proc/self/status").exists():
        pytest.skip("no /proc")
    relay = subprocess.Popen(
        [sys.executable, "-m", "cdc_relay", command, "--dsn", "host=127.0.0.1 port=1",
         "--kafka-bootstrap", "127.0.0.1:9"],
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        while not _catches_sigterm(relay.pid):
            assert relay.poll() is None, relay.stderr.read() if relay.stderr else ""
        relay.send_signal(signal.SIGTERM)
        _, stderr = relay.communicate(timeout=60)
    finally:
        relay.kill()
    assert relay.returncode == 0, stderr
    assert "stopped during start-up; nothing was relayed or confirmed" in stderr
