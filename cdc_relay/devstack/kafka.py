"""A throwaway single-node Apache Kafka broker (KRaft), from jars resolved off Maven Central."""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Final

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from cdc_relay.devstack import (
    LOOPBACK,
    DevstackError,
    LocalService,
    cache_dir,
    free_ports,
    log_tail,
    port_open,
    require_executable,
)

KAFKA_VERSION: Final = "4.1.1"
"""The Kafka release the devstack runs; ``pom.xml`` is resolved with it."""

# kafka-run-class.sh's defaults for the broker, with a smaller heap.
_BROKER_JVM_FLAGS: Final = (
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-Djava.awt.headless=true",
)
# The storage format step runs for a second: start fast rather than run fast.
_TOOL_JVM_FLAGS: Final = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC", "-Xmx256m")


def kafka_home(version: str = KAFKA_VERSION) -> Path:
    """Where the jars of Kafka ``version`` are cached (``lib/`` inside it)."""
    return cache_dir() / f"kafka-{version}"


def resolve_kafka_jars(version: str = KAFKA_VERSION) -> Path:
    """The directory of the broker's jars, resolved with Maven on first use and cached.

    Cheap once done: a marker records the pom and version the directory came from, so Maven only
    runs again when either changes. A file lock keeps concurrent callers from resolving twice.
    The Maven repository is cached next to it (``m2/``).
    """
    home = kafka_home(version)
    lib = home / "lib"
    marker = home / "resolved"
    pom = resources.files("cdc_relay.devstack").joinpath("pom.xml").read_bytes()
    stamp = hashlib.sha256(pom + version.encode()).hexdigest()
    if _read(marker) == stamp and lib.is_dir():
        return lib
    home.mkdir(parents=True, exist_ok=True)
    with _locked(home / ".lock"):
        if _read(marker) == stamp and lib.is_dir():
            return lib  # another process resolved it while we waited
        marker.unlink(missing_ok=True)
        (home / "pom.xml").write_bytes(pom)
        partial = home / "lib.partial"
        shutil.rmtree(partial, ignore_errors=True)
        mvn = require_executable("mvn", "install Maven 3 (apt-get install maven)")
        command = [
            mvn,
            "--batch-mode",
            "--quiet",
            "--no-transfer-progress",
            "--file",
            str(home / "pom.xml"),
            f"-Dmaven.repo.local={cache_dir() / 'm2'}",
            f"-Dkafka.version={version}",
            "dependency:copy-dependencies",
            f"-DoutputDirectory={partial}",
            "-DincludeScope=runtime",
        ]
        result = subprocess.run(  # noqa: S603 (fixed command of ours)
            command, cwd=home, stdin=subprocess.DEVNULL, capture_output=True, text=True
        )
        if result.returncode != 0 or not (partial / f"kafka_2.13-{version}.jar").is_file():
            output = "\n".join((result.stdout + result.stderr).splitlines()[-40:])
            raise DevstackError(
                f"Maven could not resolve the jars of Kafka {version} (exit code "
                f"{result.returncode}); is Maven Central reachable? Command: "
                f"{' '.join(command)}\n{output}"
            )
        shutil.rmtree(lib, ignore_errors=True)
        class_archive(lib).unlink(missing_ok=True)  # made from the jars being replaced
        partial.rename(lib)
        marker.write_text(stamp)
    return lib


def class_archive(lib: Path) -> Path:
    """The JVM class data archive of the broker run from the jars in ``lib``."""
    return lib.with_name(f"{lib.name}.jsa")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").is_file():
        return str(Path(java_home) / "bin" / "java")
    return require_executable("java", "install a Java 17+ runtime or set JAVA_HOME")


def new_cluster_id() -> str:
    """A random KRaft cluster id, in the form ``kafka-storage.sh random-uuid`` prints."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cluster_id.startswith("-"):  # Kafka avoids these: they read as an option
            return cluster_id


class LocalKafka(LocalService):
    """A throwaway single-node Kafka broker (KRaft combined mode) in ``base_dir``.

    Listens on 127.0.0.1 only: PLAINTEXT on ``port``, the controller on ``controller_port``
    (free ports unless given). The first start formats the storage; later starts, in this
    process or another opening the same ``base_dir``, keep the ports, cluster id and data.
    Internal topics have replication factor 1, new topics 3 partitions, and the broker logs to
    ``base_dir/kafka.log``. ``properties`` override or add server properties (more listeners, TLS,
    SASL); ``format_args`` are passed to the storage format step, e.g. ``--add-scram
    'SCRAM-SHA-512=[name=relay,password=...]'`` for the SCRAM users KRaft stores in its metadata.
    The jars come from ``resolve_kafka_jars()`` unless ``lib_dir`` is given.

    With ``class_data_sharing`` the JVM maps the classes the broker loads from an archive
    (AppCDS) next to the jars, which halves the start (about 4 s to 2 s). The first broker that
    finds no archive writes it when it stops cleanly.
    """

    name = "Kafka"

    def __init__(
        self,
        base_dir: Path | str,
        *,
        port: int | None = None,
        controller_port: int | None = None,
        lib_dir: Path | str | None = None,
        heap: str = "512m",
        properties: Mapping[str, str] | None = None,
        format_args: Sequence[str] = (),
        class_data_sharing: bool = True,
        start_timeout: float = 120.0,
        stop_timeout: float = 60.0,
    ) -> None:
        super().__init__(base_dir, start_timeout=start_timeout, stop_timeout=stop_timeout)
        self.class_data_sharing = class_data_sharing
        self._archive_dump: Path | None = None
        state = self._load_state()
        spare = free_ports(2)
        self._port: int = port or state.get("port") or spare[0]
        self._controller_port: int = controller_port or state.get("controller_port") or spare[1]
        self.cluster_id: str = state.get("cluster_id") or new_cluster_id()
        """The KRaft cluster id the storage is formatted with."""
        self._lib_dir = Path(lib_dir) if lib_dir else None
        self.heap = heap
        self.properties: dict[str, str] = dict(properties or {})
        self.format_args: tuple[str, ...] = tuple(format_args)
        self._save_state(
            {
                "port": self._port,
                "controller_port": self._controller_port,
                "cluster_id": self.cluster_id,
            }
        )

    @property
    def port(self) -> int:
        """The PLAINTEXT port on 127.0.0.1; the same across restarts."""
        return self._port

    @property
    def controller_port(self) -> int:
        """The KRaft controller's port on 127.0.0.1."""
        return self._controller_port

    @property
    def ports(self) -> Sequence[int]:
        """Both ports the broker listens on."""
        return (self._port, self._controller_port)

    @property
    def bootstrap(self) -> str:
        """The ``bootstrap.servers`` string of the broker: ``127.0.0.1:<port>``."""
        return f"{LOOPBACK}:{self._port}"

    @property
    def data_dir(self) -> Path:
        """The broker's ``log.dirs`` (also the metadata log)."""
        return self.base_dir / "data"

    @property
    def lib_dir(self) -> Path:
        """The directory of the jars (resolved on first use)."""
        if self._lib_dir is None:
            self._lib_dir = resolve_kafka_jars()
        return self._lib_dir

    def server_properties(self) -> dict[str, str]:
        """The broker's configuration, as written to ``base_dir/server.properties``."""
        plaintext = f"{LOOPBACK}:{self._port}"
        controller = f"{LOOPBACK}:{self._controller_port}"
        listeners = f"PLAINTEXT://{plaintext},CONTROLLER://{controller}"
        return {
            "process.roles": "broker,controller",
            "node.id": "1",
            # A dynamic quorum of one, as the distribution's config/server.properties sets up.
            "controller.quorum.bootstrap.servers": controller,
            "listeners": listeners,
            "advertised.listeners": listeners,
            "inter.broker.listener.name": "PLAINTEXT",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": str(self.data_dir),
            "num.partitions": "3",
            "auto.create.topics.enable": "true",
            "offsets.topic.replication.factor": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            # A new consumer group would otherwise wait 3 s for more members.
            "group.initial.rebalance.delay.ms": "0",
            # After a kill the restarted broker cannot register until the controller gives up
            # on the killed incarnation's session: 9 s by default, 4 s here. Broker and
            # controller share the JVM, so the heartbeats cannot be delayed by the network.
            "broker.heartbeat.interval.ms": "1000",
            "broker.session.timeout.ms": "4000",
            **self.properties,
        }

    # -- LocalService

    def _prepare(self) -> None:
        config = self.base_dir / "server.properties"
        config.write_text(
            "# Written by cdc_relay.devstack.kafka.LocalKafka at every start.\n"
            + "".join(
                f"{key}={value.replace(chr(92), chr(92) * 2)}\n"
                for key, value in self.server_properties().items()
            )
        )
        logging_config = self.base_dir / "log4j2.properties"
        logging_config.write_bytes(
            resources.files("cdc_relay.devstack").joinpath("log4j2.properties").read_bytes()
        )
        if not (self.data_dir / "meta.properties").is_file():
            self._format()

    def _java_command(self, flags: Sequence[str], main: str, *args: str) -> list[str]:
        return [
            _java(),
            *flags,
            f"-Dlog4j2.configurationFile={self.base_dir / 'log4j2.properties'}",
            "-cp",
            f"{self.lib_dir}/*",  # java expands the wildcard itself
            main,
            *args,
        ]

    def _format(self) -> None:
        command = self._java_command(
            _TOOL_JVM_FLAGS,
            "kafka.tools.StorageTool",
            "format",
            "--standalone",
            "--cluster-id",
            self.cluster_id,
            "--config",
            str(self.base_dir / "server.properties"),
            *self.format_args,
        )
        with self.log_path.open("ab") as log_file:
            log_file.write(b"--- devstack: formatting the storage ---\n")
            log_file.flush()
            code = subprocess.call(  # noqa: S603 (fixed command of ours)
                command,
                cwd=self.base_dir,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        if code != 0:
            raise DevstackError(
                f"formatting Kafka's storage failed with code {code}; last lines of "
                f"{self.log_path}:\n{log_tail(self.log_path)}"
            )

    def _command(self) -> list[str]:
        return self._java_command(
            (f"-Xmx{self.heap}", f"-Xms{self.heap}", *_BROKER_JVM_FLAGS, *self._archive_flags()),
            "kafka.Kafka",
            str(self.base_dir / "server.properties"),
        )

    def _archive_flags(self) -> list[str]:
        self._archive_dump = None
        if not self.class_data_sharing:
            return []
        archive = class_archive(self.lib_dir)
        if archive.is_file():
            # A stale or foreign archive (another JVM build) is ignored with a warning in the log.
            return [f"-XX:SharedArchiveFile={archive}"]
        if not os.access(archive.parent, os.W_OK):
            return []
        # Dumped into base_dir at exit, and kept only after a clean stop: a killed JVM's is partial.
        self._archive_dump = self.base_dir / "broker.jsa"
        self._archive_dump.unlink(missing_ok=True)
        return [f"-XX:ArchiveClassesAtExit={self._archive_dump}"]

    def _keep_archive(self) -> None:
        dump, self._archive_dump = self._archive_dump, None
        if dump is None or not dump.is_file():
            return
        archive = class_archive(self.lib_dir)
        partial = archive.with_name(f"{archive.name}.{os.getpid()}.partial")
        shutil.copyfile(dump, partial)  # base_dir may be on another file system
        os.replace(partial, archive)  # atomic: brokers starting meanwhile see all or nothing
        dump.unlink()

    def _ready(self) -> bool:
        if not port_open(self._port):
            return False  # saves librdkafka's connection-refused noise on stderr
        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})
        try:
            metadata = admin.list_topics(timeout=2)
        except KafkaException:
            return False
        return bool(metadata.brokers)

    def stop(self) -> None:
        """SIGTERM the broker, which shuts down cleanly (as kafka-server-stop.sh does)."""
        self._stop(signal.SIGTERM)
        self._keep_archive()

    def kill(self) -> None:
        """SIGKILL the broker, as a crash would."""
        super().kill()
        self._archive_dump = None
