"""A contestant's process: started in its own process group, its memory sampled while it
runs, and reaped with its resource usage (CPU seconds of it and its descendants)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from cdc_relay.devstack import _Watchdog, log_tail

_SAMPLE_INTERVAL = 0.2


@dataclass(frozen=True)
class Usage:
    """What a finished process used."""

    cpu_s: float
    """User + system CPU seconds of the process and of the descendants it reaped."""
    peak_rss_bytes: int
    """The larger of: the peak of the summed RSS of its process tree, and the kernel's
    high-water mark (VmHWM) of any one process in it, both sampled every 0.2 s."""
    exit_code: int
    wall_s: float


def _high_water_mark(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def server_cpu(pid: int) -> float:
    """CPU seconds a server and all its processes have used so far, exited ones included.

    The server's own times plus those of the children it reaped, plus its live children's: a
    difference of two readings is what the server used in between, whichever backends came
    and went meanwhile.
    """
    try:
        server = psutil.Process(pid)
        times = server.cpu_times()
        total = times.user + times.system + times.children_user + times.children_system
        children = server.children()
    except psutil.Error:
        return 0.0
    for child in children:
        with contextlib.suppress(psutil.Error):
            times = child.cpu_times()
            total += times.user + times.system
    return total


class Process:
    """One run of a contestant's command; ``stop`` or ``wait`` returns its ``Usage``."""

    def __init__(
        self,
        command: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.command = list(command)
        self.log_path = log_path
        self.env = dict(env or {})
        self.cwd = cwd
        self.started = 0.0
        """``time.time()`` just before the process was started."""
        self._proc: subprocess.Popen[bytes] | None = None
        self._watchdog: _Watchdog | None = None
        self._sampler: threading.Thread | None = None
        self._done = threading.Event()
        self._peak_tree = 0
        self._peak_single = 0
        self._usage: Usage | None = None

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def start(self) -> Process:
        with self.log_path.open("ab") as log:
            self.started = time.time()
            self._proc = subprocess.Popen(
                self.command,
                env={**os.environ, **self.env},
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: a kill reaches every descendant
            )
        # Should the harness die, the contestant goes with it.
        self._watchdog = _Watchdog(self._proc.pid)
        self._sampler = threading.Thread(target=self._sample, name="sampler", daemon=True)
        self._sampler.start()
        return self

    def _sample(self) -> None:
        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._done.is_set():
            with contextlib.suppress(psutil.Error):
                tree = [root, *root.children(recursive=True)]
                total = 0
                for proc in tree:
                    with contextlib.suppress(psutil.Error):
                        total += proc.memory_info().rss
                        self._peak_single = max(self._peak_single, _high_water_mark(proc.pid))
                self._peak_tree = max(self._peak_tree, total)
            self._done.wait(_SAMPLE_INTERVAL)

    def cpu_now(self) -> float:
        """User + system CPU seconds its process tree has used so far."""
        total = 0.0
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.pid)
            for proc in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    times = proc.cpu_times()
                    total += times.user + times.system
        return total

    def alive(self) -> bool:
        return self._usage is None and self._reap(block=False) is None

    def _reap(self, block: bool) -> Usage | None:
        if self._usage is not None:
            return self._usage
        pid, status, rusage = os.wait4(self.pid, 0 if block else os.WNOHANG)
        if pid == 0:
            return None
        ended = time.time()
        self._done.set()
        assert self._proc is not None and self._sampler is not None
        self._proc.returncode = os.waitstatus_to_exitcode(status)
        self._sampler.join()
        if self._watchdog is not None:
            self._watchdog.disarm()
            self._watchdog = None
        self._usage = Usage(
            cpu_s=rusage.ru_utime + rusage.ru_stime,
            # Not ru_maxrss: Linux carries over the RSS of the forked harness from before exec.
            peak_rss_bytes=max(self._peak_tree, self._peak_single),
            exit_code=self._proc.returncode,
            wall_s=ended - self.started,
        )
        return self._usage

    def wait(self, timeout: float) -> Usage | None:
        """Its usage once it has exited by itself, or None after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while (usage := self._reap(block=False)) is None:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)
        return usage

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> tuple[Usage, bool]:
        """Send ``sig``, wait for the exit; kill the group after ``timeout``.

        Returns the usage and whether it stopped by itself (False: it had to be killed).
        """
        if self._usage is not None:
            return self._usage, True
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)
        usage = self.wait(timeout)
        if usage is not None:
            return usage, True
        self.kill()
        assert self._usage is not None
        return self._usage, False

    def kill(self) -> None:
        if self._usage is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self._reap(block=True)

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)
