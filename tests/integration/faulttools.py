"""Helpers of the fault-injection tests: a TCP proxy a test can cut, the bookkeeping of one
scenario (its faults, the in-flight bound, the recovery times) and the table of results
printed at the end of the run.

Recovery time is measured, never asserted beyond a liveness bound: the topics are created
with ``message.timestamp.type=LogAppendTime``, so each message carries the broker's clock at
the moment it was appended, and the recovery after a fault is the time from the fault's end
to the first message appended after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import statistics
import struct
import threading
import time
from collections.abc import Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import psycopg
import pytest
from confluent_kafka.admin import AdminClient, NewTopic
from relaytools import (
    Load,
    Received,
    RelayProcess,
    Verdict,
    Written,
    check,
    consume,
    install_poller,
    relay_env,
    setup_slot,
    slot_row,
    wait_until,
)

from cdc_relay.devstack import free_ports
from cdc_relay.devstack.kafka import LocalKafka

CHAOS = os.environ.get("CDC_RELAY_CHAOS", "") not in ("", "0")
"""The long version (``make chaos``): more kills, longer outages."""

KILLS = 20 if CHAOS else 5
OUTAGE = 30.0 if CHAOS else 5.0  # seconds a service or the network stays away
RECOVERY_LIMIT = 60.0  # the liveness bound: a relay that takes longer has not recovered

AGGREGATE_TYPES = ("order", "customer")  # what relaytools.Load writes
POLL_WORKERS = 2
POLL_BATCH = 100

T = TypeVar("T")


# -- a TCP proxy the test controls -------------------------------------------------------------

Mode = Literal["refuse", "blackhole", "stall"]


class TcpProxy:
    """Forwards a free loopback port to ``upstream`` until ``cut``.

    ``cut(mode)`` until ``restore()``:

    - ``refuse``: every connection is reset, on both sides (a RST, as a firewall's reject with
      tcp-reset or a crashed middlebox gives), and so is every new one, at once.
    - ``blackhole``: every connection is reset; new ones complete the TCP handshake (the
      kernel does that) and then hear nothing until ``restore()`` connects them through, as a
      dropped SYN retransmitted after the outage would be.
    - ``stall``: nothing is reset, nothing moves: every connection, old or new, hears
      nothing until ``restore()``, then carries on (a partition shorter than TCP's timeouts).

    An asyncio loop in a daemon thread; every method may be called from the test's thread.
    """

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.accepted = 0  # connections accepted, whatever happened to them
        self._mode: Mode | None = None
        self._links: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"proxy-{upstream_port}", daemon=True
        )
        self._thread.start()
        self._reopened: asyncio.Future[None] | None = None
        self._server = self._call(
            asyncio.start_server(self._accept, "127.0.0.1", 0, reuse_address=True)
        )
        self.port: int = self._server.sockets[0].getsockname()[1]

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(30)

    def cut(self, mode: Mode = "refuse") -> None:
        """Cut the connections, old and new, as ``mode`` says, until ``restore``."""
        self._call(self._cut(mode))

    def restore(self) -> None:
        """Forward again: held connections are connected through, stalled ones go on."""
        self._call(self._restore())

    def close(self) -> None:
        """Stop listening and reset every connection."""
        if self._loop.is_closed():
            return
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()

    async def _cut(self, mode: Mode) -> None:
        self._mode = mode
        if self._reopened is None:
            self._reopened = self._loop.create_future()
        if mode == "stall":
            return
        for client, server in list(self._links):
            _reset(client)
            _reset(server)

    async def _gate(self, *modes: Mode) -> None:
        """Wait while the proxy is cut in one of ``modes``."""
        while self._mode in modes and self._reopened is not None:
            await asyncio.shield(self._reopened)

    async def _restore(self) -> None:
        self._mode = None
        self._reopen()

    def _reopen(self) -> None:
        """Let the connections waiting at a gate go on, to whatever the mode now says."""
        if self._reopened is not None:
            self._reopened.set_result(None)
            self._reopened = None

    async def _close(self) -> None:
        self._server.close()
        await self._cut("refuse")
        self._reopen()  # held connections are reset now, and the handlers end
        if self._handlers:
            await asyncio.wait(self._handlers, timeout=10)
        await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        try:
            await self._handle(reader, writer)
        finally:
            self._handlers.discard(handler)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._gate("blackhole", "stall")
        if self._mode == "refuse":
            _reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            _reset(writer)
            return
        link = (writer, up_writer)
        self._links.add(link)
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        finally:
            self._links.discard(link)
            writer.close()
            up_writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await self._gate("stall")
                writer.write(data)
                await writer.drain()
            await self._gate("stall")  # a stalled network carries no FIN either
            if writer.can_write_eof():
                writer.write_eof()  # pass the half-close on
        except OSError:  # reset, by a peer or by cut()
            writer.transport.abort()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a RST rather than a FIN: SO_LINGER with a zero timeout, then close."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


# -- a broker behind a proxy -------------------------------------------------------------------


class ProxiedKafka:
    """A broker of its own that clients reach through a TcpProxy.

    A client asks the broker it bootstraps from where each broker is, and connects there: the
    broker must name the proxy. So the broker has a listener EXTERNAL behind the proxy,
    advertised as the proxy's address, next to its ordinary PLAINTEXT listener, which the
    test's own clients use directly and which stays up through a cut.
    """

    def __init__(self, base_dir: Path) -> None:
        plaintext, controller, external = free_ports(3)
        self.proxy = TcpProxy("127.0.0.1", external)
        self.broker = LocalKafka(
            base_dir,
            port=plaintext,
            controller_port=controller,
            heap="384m",
            properties={
                "listeners": f"PLAINTEXT://127.0.0.1:{plaintext},"
                f"EXTERNAL://127.0.0.1:{external},CONTROLLER://127.0.0.1:{controller}",
                "advertised.listeners": f"PLAINTEXT://127.0.0.1:{plaintext},"
                f"EXTERNAL://127.0.0.1:{self.proxy.port},CONTROLLER://127.0.0.1:{controller}",
                "listener.security.protocol.map": (
                    "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,EXTERNAL:PLAINTEXT"
                ),
            },
        )

    @property
    def relay_bootstrap(self) -> str:
        return f"127.0.0.1:{self.proxy.port}"


def proxied_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxiedKafka]:
    """A ProxiedKafka for the tests of a module (a fixture's body: the broker is its own, not
    the session's, so one named by CDC_RELAY_TEST_KAFKA_BOOTSTRAP skips them)."""
    if os.environ.get("CDC_RELAY_TEST_KAFKA_BOOTSTRAP"):
        pytest.skip("the broker is given by CDC_RELAY_TEST_KAFKA_BOOTSTRAP: no broker of our own")
    kafka = ProxiedKafka(tmp_path_factory.mktemp("kafka_proxied"))
    try:
        kafka.broker.start()
        yield kafka
    finally:
        kafka.proxy.close()
        kafka.broker.kill()  # its data goes anyway: no need to wait for a clean stop
        kafka.broker.cleanup(keep_logs=True)


# -- one scenario -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instant:
    mono: float = field(default_factory=time.monotonic)  # compared with Written.committed_at
    wall: float = field(default_factory=time.time)  # compared with Kafka's LogAppendTime


@dataclass(frozen=True)
class Fault:
    """One fault, from ``began`` to ``ended`` (the service back, the network restored, the relay
    restarted). A message appended after ``quiet_from`` counts as delivered after the fault:
    that is ``ended``, or earlier when nothing can be appended meanwhile (the broker is gone),
    but not when something can (a relay cut off from PostgreSQL still delivers what it holds)."""

    what: str
    began: Instant
    ended: Instant
    quiet_from: Instant
    in_flight_until: float  # events committed before this (monotonic) may have been in flight
    confirmed_lsn: int | None  # stream: the slot's confirmed position when the fault began


@dataclass
class Result:
    scenario: str
    relay: str
    written: int
    lost: int
    duplicated: int
    bound: int
    out_of_order: int
    mismatched: int
    recoveries: list[float | None]

    def row(self) -> str:
        return (
            f"| {self.scenario} | {self.relay} | {self.written} | {self.lost} | "
            f"{self.duplicated} ({self.bound}) | {self.out_of_order} | {self.recovery_text()} |\n"
        )

    def recovery_text(self) -> str:
        measured = [r for r in self.recoveries if r is not None]
        if not measured:
            return "none"
        if len(self.recoveries) == 1:
            return f"{measured[0]:.1f} s"
        text = f"median {statistics.median(measured):.1f} s, max {max(measured):.1f} s"
        missed = len(self.recoveries) - len(measured)
        if missed:
            text += f" ({missed} of {len(self.recoveries)} killed again before delivering)"
        return text


class ResultsTable:
    """The rows of the run, as a Markdown table in a file and at the end of pytest's output."""

    HEADER = (
        "| scenario | relay | events written | lost | duplicated (bound) | out of order "
        "| recovery: fault end -> first delivery |\n|---|---|---:|---:|---:|---:|---|\n"
    )

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[Result] = []

    def add(self, result: Result) -> None:
        self.rows.append(result)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(self.markdown())

    def markdown(self) -> str:
        mode = "long (make chaos)" if CHAOS else "short"
        lines = [
            f"Fault injection, {mode} version: {KILLS} kills, outages of {OUTAGE:g} s.\n\n",
            self.HEADER,
        ]
        lines.extend(r.row() for r in self.rows)
        return "".join(lines)

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.rows:
            return
        terminalreporter.write_sep("=", "fault injection results")
        terminalreporter.write(self.markdown())
        terminalreporter.write_line(f"(written to {self.path})")


def create_topics(bootstrap: str, topic_prefix: str) -> None:
    """The scenario's topics, stamped by the broker (LogAppendTime) so deliveries are timed."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    topics = [
        NewTopic(
            f"{topic_prefix}.{aggregate_type}",
            num_partitions=3,
            replication_factor=1,
            config={"message.timestamp.type": "LogAppendTime"},
        )
        for aggregate_type in AGGREGATE_TYPES
    ]
    for future in admin.create_topics(topics).values():
        future.result(timeout=60)


@dataclass
class Outcome:
    """What one relay made of a scenario."""

    kind: str
    relay: RelayProcess
    verdict: Verdict
    result: Result


@dataclass
class FaultRun:
    """One scenario: a write load, the relays of ``kinds`` (each with its own topics, all
    relaying the same events), the faults injected, and the verdict on each relay.

    ``dsn`` and ``bootstrap`` are the services as the test reaches them; ``relay_dsn`` and
    ``relay_bootstrap`` as the relays do (through a proxy, for the network scenarios).
    """

    scenario: str
    kinds: Sequence[str]  # "stream", "stream-eos" (--exactly-once), "poll"
    dsn: str
    bootstrap: str
    names: Any
    log_dir: Path
    table: ResultsTable
    relay_dsn: str = ""
    relay_bootstrap: str = ""
    faults: list[Fault] = field(default_factory=list)
    load: Load | None = None
    relays: dict[str, RelayProcess] = field(init=False)

    def __post_init__(self) -> None:
        self.relay_dsn = self.relay_dsn or self.dsn
        self.relay_bootstrap = self.relay_bootstrap or self.bootstrap
        self.relays = {}
        for kind in self.kinds:
            create_topics(self.bootstrap, self.topic_prefix(kind))
            extra = {"topic_template": self.topic_prefix(kind) + ".{aggregate_type}"}
            if kind == "stream":
                setup_slot(self.dsn, self.names)
            elif kind == "stream-eos":
                setup_slot(self.dsn, self.names, slot=self.slot(kind))
                extra.update(
                    slot=self.slot(kind),
                    exactly_once="1",
                    checkpoint_topic=self.topic_prefix(kind) + "_checkpoints",
                )
            else:
                install_poller(self.dsn)
                extra.update(
                    poll_interval="1", workers=str(POLL_WORKERS), batch_size=str(POLL_BATCH)
                )
            env = relay_env(self.relay_dsn, self.relay_bootstrap, self.names, **extra)
            command = "stream" if kind == "stream-eos" else kind
            self.relays[kind] = RelayProcess(self.log_dir, env, name=kind, command=command)

    def topic_prefix(self, kind: str) -> str:
        return f"{self.names.topic_prefix}_{kind.replace('-', '_')}"

    def slot(self, kind: str) -> str:
        """The slot a stream relay of ``kind`` reads."""
        return self.names.slot + ("_eos" if kind == "stream-eos" else "")

    @property
    def relay(self) -> RelayProcess:
        """The relay of a scenario that runs one."""
        (relay,) = self.relays.values()
        return relay

    # -- running

    def start(self) -> FaultRun:
        """Start the relays and the write load; return once events flow through every relay."""
        for relay in self.relays.values():
            relay.start()
        self.load = Load(self.dsn, writers=2, pause=0.01, reconnect=True).start()
        self.wait_delivering()
        return self

    def progress(self, kind: str) -> int:
        """A number that grows as the relay delivers: the slot's confirmed position for
        stream (it moves only past acknowledged events), processed rows for poll."""
        if kind.startswith("stream"):
            return self.confirmed_lsn(kind) or 0
        return int(self._one("SELECT count(*) FROM outbox_events WHERE processed_at IS NOT NULL"))

    def confirmed_lsn(self, kind: str | None = None) -> int | None:
        """A stream relay's slot's confirmed position (the first stream relay's by default):
        everything before it is on Kafka."""
        kind = kind or next((k for k in self.relays if k.startswith("stream")), None)
        if kind is None:
            return None
        return int(
            self._one(
                "SELECT pg_wal_lsn_diff(confirmed_flush_lsn, '0/0')::bigint "
                "FROM pg_replication_slots WHERE slot_name = %s",
                self.slot(kind),
            )
        )

    def _one(self, query: str, *params: Any) -> Any:
        with psycopg.connect(self.dsn, autocommit=True, connect_timeout=5) as conn:
            row = conn.execute(query, params).fetchone()
        assert row is not None
        return row[0]

    def wait_delivering(self, timeout: float = RECOVERY_LIMIT) -> None:
        """Wait until every relay delivers: its progress moves."""
        assert self.load is not None
        assert not self.load.errors, self.load.errors
        for kind in self.relays:
            start = self.progress(kind)
            wait_until(
                lambda kind=kind, start=start: self.progress(kind) > start,
                timeout,
                f"the {kind} relay to deliver",
                0.1,
            )

    @contextlib.contextmanager
    def fault(self, what: str, *, quiet_early: bool = False) -> Iterator[_FaultMarks]:
        """Record the fault the block injects: from entering the block until its end (the
        block may call ``marks.quiet()`` once no delivery can happen, with ``quiet_early``)."""
        marks = _FaultMarks(confirmed_lsn=self.confirmed_lsn())
        yield marks
        ended = Instant()
        self.faults.append(
            Fault(
                what=what,
                began=marks.began,
                ended=ended,
                quiet_from=marks.quiet_at if quiet_early and marks.quiet_at else ended,
                in_flight_until=ended.mono,
                confirmed_lsn=marks.confirmed_lsn,
            )
        )

    def restart(self, *, graceful: bool = False, cwd: Path | None = None) -> None:
        """SIGKILL the relay (SIGTERM with ``graceful``: it must exit 0), wait until its slot is
        free (stream), start it again (in ``cwd``)."""
        relay = self.relay
        if graceful:
            assert relay.stop() == 0, relay.log()[-5000:]
        else:
            relay.kill()
        killed = Instant()
        (kind,) = self.relays
        if kind.startswith("stream"):
            wait_until(
                lambda: not slot_row(self.dsn, self.slot(kind))["active"],
                30,
                "the slot to be free",
                0.05,
            )
        confirmed = self.confirmed_lsn()  # the dead relay can confirm no more
        relay.cwd = cwd
        relay.start()
        restarted = Instant()
        self.faults.append(
            Fault(
                what="SIGTERM" if graceful else "SIGKILL",
                began=killed,
                ended=restarted,
                quiet_from=restarted,
                in_flight_until=killed.mono,
                confirmed_lsn=confirmed,
            )
        )

    # -- the verdict

    def finish(self) -> list[Outcome]:
        """Stop the load once the relays deliver again after the last fault, read what Kafka
        holds, and add a row per relay to the table."""
        assert self.load is not None
        if all(relay.alive() for relay in self.relays.values()):
            with contextlib.suppress(AssertionError):  # the checks after say what went wrong
                self.wait_delivering()
        written = self.load.stop()
        outcomes = []
        for kind, relay in self.relays.items():
            prefix = self.topic_prefix(kind)
            received = consume(self.bootstrap, prefix, len(written), settle=1.0)
            verdict = check(written, received, prefix)
            result = Result(
                scenario=self.scenario,
                relay=kind,
                written=verdict.written,
                lost=len(verdict.lost),
                duplicated=verdict.duplicates,
                bound=self.in_flight_bound(kind, written),
                out_of_order=len(verdict.out_of_order),
                mismatched=len(verdict.mismatched),
                recoveries=self.recoveries(received),
            )
            self.table.add(result)
            print(self.scenario, kind, verdict, f"bound={result.bound}", result.recovery_text())
            outcomes.append(Outcome(kind, relay, verdict, result))
        return outcomes

    def in_flight_bound(self, kind: str, written: Sequence[Written]) -> int:
        """How many events the faults may have sent twice, summed over the faults.

        stream: the events in flight, committed before the fault and past the position the
        slot had confirmed (PostgreSQL replays from there). poll: the batches claimed and not
        yet marked, at most one per worker.
        """
        if kind == "poll":
            return len(self.faults) * POLL_WORKERS * POLL_BATCH
        if kind == "stream-eos":
            return 0  # exactly once: a read_committed consumer sees no duplicate
        return sum(
            sum(
                1
                for w in written
                if w.committed_at < f.in_flight_until
                and w.after_commit_lsn > (f.confirmed_lsn or 0)
            )
            for f in self.faults
        )

    def recoveries(self, received: Iterable[Received]) -> list[float | None]:
        """Per fault: from its end to the first message appended after it and before the next
        fault began; None if there was none."""
        stamps = sorted(r.timestamp for r in received if r.timestamp is not None)
        recoveries: list[float | None] = []
        for n, f in enumerate(self.faults):
            until = self.faults[n + 1].began.wall if n + 1 < len(self.faults) else float("inf")
            first = next((t for t in stamps if f.quiet_from.wall < t < until), None)
            recoveries.append(None if first is None else max(0.0, first - f.ended.wall))
        return recoveries

    @staticmethod
    def assert_sound(outcomes: Sequence[Outcome], *, restarts: int = 1) -> None:
        """For each relay: nothing lost, altered or reordered; duplicates within the bound;
        alive, started ``restarts`` times, and delivering within the liveness bound after the
        last fault."""
        for o in outcomes:
            log = o.relay.log()[-5000:]
            assert o.verdict.lost == [], f"{o.kind}: {len(o.verdict.lost)} events lost\n{log}"
            assert o.verdict.mismatched == [], o.kind
            assert o.verdict.out_of_order == [], f"{o.kind}: {o.verdict.out_of_order}"
            assert o.verdict.duplicates <= o.result.bound, o.kind
            assert o.relay.alive(), f"the {o.kind} relay exited\n{log}"
            assert o.relay.runs == restarts, f"{o.kind}: {o.relay.runs} runs, not {restarts}"
            last = o.result.recoveries[-1]
            assert last is not None, f"{o.kind}: nothing delivered after the last fault\n{log}"
            assert last <= RECOVERY_LIMIT, o.kind

    def close(self) -> None:
        if self.load is not None:
            with contextlib.suppress(AssertionError):  # reported by finish(), if it ran
                self.load.stop()
        for relay in self.relays.values():
            relay.close()


@dataclass
class _FaultMarks:
    confirmed_lsn: int | None
    began: Instant = field(default_factory=Instant)
    quiet_at: Instant | None = None

    def quiet(self) -> None:
        """From now until the fault ends, no message can be appended (the broker is gone)."""
        self.quiet_at = Instant()
