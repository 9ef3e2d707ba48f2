"""Throwaway local PostgreSQL and Kafka for the test suite, the demo and the benchmarks.

The services are ``cdc_relay.devstack.postgres.LocalPostgres`` and
``cdc_relay.devstack.kafka.LocalKafka``; ``python -m cdc_relay.devstack`` is the command line.
This module holds what both share: the lifecycle of one server process (start and wait until it
answers, stop by signal, kill, restart), a watchdog that takes the server down with us, port
picking and the cache directory.
"""

from __future__ import annotations

import abc
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Self

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


class DevstackError(Exception):
    """A local service could not be set up, started or stopped; the message says why."""


def cache_dir() -> Path:
    """The per-user cache of downloads: ``$XDG_CACHE_HOME/cdc-relay`` or ``~/.cache/cdc-relay``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cdc-relay"


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


_handed_out: set[int] = set()


def free_ports(count: int = 1) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1 that nothing is bound to right now.

    The ports come from below the kernel's ephemeral range when possible: a service that is
    restarted must bind its port again, and a port from the ephemeral range may meanwhile have
    become the local end of some outgoing connection. A port is handed out once per process:
    services made one after the other (the demo's Kafka, then its PostgreSQL, which binds its
    port first) never share one. Another process can still take a port before the service
    binds it; the tests accept that race.
    """
    low, _ = _ephemeral_range()
    candidates = list(range(15000, low)) if low > 16000 else []
    random.shuffle(candidates)
    ports: list[int] = []
    with contextlib.ExitStack() as held:
        for candidate in [*candidates[:200], *([0] * (count + 64))]:
            if candidate in _handed_out:
                continue
            sock = held.enter_context(socket.socket())
            try:
                sock.bind((LOOPBACK, candidate))
            except OSError:
                continue
            port: int = sock.getsockname()[1]
            if port in _handed_out:
                continue
            ports.append(port)
            if len(ports) == count:
                _handed_out.update(ports)
                return ports
    raise DevstackError(f"found no {count} free TCP port(s) on {LOOPBACK}")


def port_open(port: int, host: str = LOOPBACK) -> bool:
    """Whether something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file, or a note that there is none."""
    try:
        with path.open("rb") as file:
            file.seek(0, os.SEEK_END)
            file.seek(max(0, file.tell() - 64 * 1024))
            text = file.read().decode("utf-8", "replace")
    except OSError as err:
        return f"(no log: {err})"
    return "\n".join(text.splitlines()[-lines:])


def require_executable(name: str, hint: str) -> str:
    """The path of an executable on PATH, or a DevstackError that says how to get it."""
    found = shutil.which(name)
    if found is None:
        raise DevstackError(f"{name} not found on PATH; {hint}")
    return found


# The watchdog is a tiny Python process holding the read end of a pipe whose write end only we
# hold. When we exit in any way, SIGKILL and crashes included, the pipe reaches end-of-file and
# the watchdog kills the server's process group and removes the server's temporary directories;
# a stop writes a byte first, which disarms it. This is what prctl(PR_SET_PDEATHSIG) would give,
# without preexec_fn and for every exit path.
_WATCHDOG_CODE = """\
import os, shutil, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
if not sys.stdin.buffer.read():
    try:
        os.killpg(int(sys.argv[1]), signal.SIGKILL)
    except ProcessLookupError:
        pass
    for path in sys.argv[2:]:
        for _ in range(50):  # the server's other processes may still be writing for a moment
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.lexists(path):
                break
            time.sleep(0.1)
"""


class _Watchdog:
    """Kills a process group (and removes ``paths``) if we end before calling ``disarm()``."""

    def __init__(self, pgid: int, paths: Sequence[Path] = ()) -> None:
        read_end, self._write_end = os.pipe()  # not inheritable: no other child keeps it open
        try:
            self._process = subprocess.Popen(  # noqa: S603 (our own interpreter and code)
                [sys.executable, "-I", "-S", "-c", _WATCHDOG_CODE, str(pgid), *map(str, paths)],
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                # its own session, so a Ctrl-C meant for the tests does not reach it
                start_new_session=True,
            )
        finally:
            os.close(read_end)

    def disarm(self) -> None:
        """Let the watchdog exit without killing anything."""
        with contextlib.suppress(OSError):
            os.write(self._write_end, b"x")
        os.close(self._write_end)
        self._process.wait()


class LocalService(abc.ABC):
    """One local server process whose files live in ``base_dir``.

    Subclasses say how to prepare the files (``_prepare``), which command runs the server
    (``_command``) and when it is ready (``_ready``). The server runs in its own process group,
    with stdout and stderr appended to ``log_path``; a watchdog kills it if we die first.

    The process is driven with plain ``subprocess`` rather than mirakuru: mirakuru's exit
    handler kills every process whose ``mirakuru_uuid`` variable merely *contains* the exiting
    interpreter's pid as a substring, so a test run ending could kill services of another
    concurrent run; and its ``stop()`` signals the whole process group, which turns PostgreSQL's
    smart shutdown (SIGTERM to the postmaster only) into terminating every backend.
    """

    name: ClassVar[str]
    """Human-readable name used in messages and the log file's name."""

    def __init__(self, base_dir: Path | str, *, start_timeout: float, stop_timeout: float) -> None:
        self.base_dir = Path(base_dir).absolute()
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.log_path = self.base_dir / f"{self.name.lower()}.log"
        self._state_path = self.base_dir / "devstack.json"
        self._process: subprocess.Popen[bytes] | None = None
        self._watchdog: _Watchdog | None = None

    # -- what a subclass provides

    @abc.abstractmethod
    def _prepare(self) -> None:
        """Create whatever a start needs and is not there yet; idempotent."""

    @abc.abstractmethod
    def _command(self) -> list[str]:
        """The command line of the server process."""

    @abc.abstractmethod
    def _ready(self) -> bool:
        """Whether the server answers requests; called every 0.1 s while it starts."""

    @property
    @abc.abstractmethod
    def ports(self) -> Sequence[int]:
        """Every TCP port the server listens on; checked for being free before a start."""

    @property
    def _outside_paths(self) -> Sequence[Path]:
        """Directories of the server outside ``base_dir``, removed with it."""
        return ()

    # -- state kept in base_dir so that another process can reopen the same service

    def _load_state(self) -> dict[str, Any]:
        try:
            state: dict[str, Any] = json.loads(self._state_path.read_text())
        except FileNotFoundError:
            return {}
        return state

    def _save_state(self, state: dict[str, Any]) -> None:
        self._state_path.write_text(json.dumps(state, indent=2) + "\n")

    # -- lifecycle

    def running(self) -> bool:
        """Whether the server process is alive (not necessarily ready)."""
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    def start(self) -> Self:
        """Start the server and wait until it answers; a no-op when it already runs."""
        if self.running():
            return self
        self._forget()  # a server that died on its own leaves an armed watchdog behind
        self._prepare()
        busy = [port for port in self.ports if port_open(port)]
        if busy:
            raise DevstackError(
                f"cannot start {self.name}: port(s) {busy} on {LOOPBACK} already accept "
                f"connections (another devstack running on {self.base_dir}?)"
            )
        command = self._command()
        log.debug("starting %s: %s", self.name, command, extra={"action": "devstack_start"})
        with self.log_path.open("ab") as log_file:
            log_file.write(f"--- devstack: {self.name} starting at {time.ctime()} ---\n".encode())
            log_file.flush()
            self._process = subprocess.Popen(  # noqa: S603 (fixed command of ours)
                command,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=self.base_dir,
                # its own process group: kill() reaches every child, Ctrl-C does not
                start_new_session=True,
            )
        self._watchdog = _Watchdog(self._process.pid, self._outside_paths)
        try:
            self._wait_ready(self._process)
        except BaseException:
            self.kill()
            raise
        return self

    def _wait_ready(self, process: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            code = process.poll()
            if code is not None:
                raise DevstackError(
                    f"{self.name} exited with code {code} while starting; "
                    f"last lines of {self.log_path}:\n{log_tail(self.log_path)}"
                )
            if self._ready():
                return
            if time.monotonic() > deadline:
                raise DevstackError(
                    f"{self.name} did not get ready within {self.start_timeout:g} s; "
                    f"last lines of {self.log_path}:\n{log_tail(self.log_path)}"
                )
            time.sleep(0.1)

    def _stop(self, sig: int) -> None:
        """Send ``sig`` to the server process only and wait for it to exit."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(sig)
            try:
                process.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise DevstackError(
                    f"{self.name} did not stop within {self.stop_timeout:g} s of "
                    f"{signal.Signals(sig).name}; killed it. Last lines of {self.log_path}:\n"
                    f"{log_tail(self.log_path)}"
                ) from None
        self._forget()

    def kill(self) -> None:
        """SIGKILL the server and every process of its group at once, as a crash would."""
        process = self._process
        if process is not None and process.returncode is None:
            # While the leader is not reaped its pid cannot name another group.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        self._forget()

    def _forget(self) -> None:
        if self._watchdog is not None:
            self._watchdog.disarm()
            self._watchdog = None
        self._process = None

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop the server cleanly."""

    def restart(self) -> Self:
        """Stop cleanly and start again, on the same ports and with the same data."""
        self.stop()
        return self.start()

    def cleanup(self, *, keep_logs: bool = False) -> None:
        """Stop the server (killing it if it will not stop) and remove its files.

        With ``keep_logs`` the log file stays in ``base_dir`` for a post-mortem.
        """
        try:
            self.stop()
        except DevstackError:
            log.warning("%s did not stop cleanly during cleanup", self.name, exc_info=True)
        self.kill()
        for path in self._outside_paths:
            shutil.rmtree(path, ignore_errors=True)
        if not keep_logs:
            shutil.rmtree(self.base_dir, ignore_errors=True)
            return
        for path in self.base_dir.iterdir():
            if path == self.log_path:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.cleanup()
