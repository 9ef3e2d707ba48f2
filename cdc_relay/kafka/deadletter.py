"""Dead letters: events Kafka refused for good.

The stream's (``--dead-letter-topic``): its whole content goes to the table
``cdc_relay_dead_letters`` (cdc-relay schema outbox) before the slot moves past it, then to the
dead-letter topic: with the payload when the topic takes it, without when the payload is what
Kafka refused. So no event's content exists nowhere, whatever the row or the logical message
it came from becomes.

The poller's: rows it gave up on after --max-attempts, parked in the outbox (retry_after =
'infinity'), listed and queued again by ``cdc-relay dead-letters``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import psycopg
from confluent_kafka import KafkaError
from psycopg.rows import dict_row

from cdc_relay.errors import DeliveryError, PreflightError, RelayError
from cdc_relay.kafka.refusals import RefusalPolicy, header, is_culprit, log_refusal
from cdc_relay.kafka.routing import Message, TopicTaken
from cdc_relay.lsn import format_lsn
from cdc_relay.metrics import count_failed
from cdc_relay.postgres import store
from cdc_relay.postgres.connection import connect
from cdc_relay.postgres.replication import ConnectionLost
from cdc_relay.postgres.store import refused, resolve
from cdc_relay.queries import QUERIES

log = logging.getLogger(__name__)

TABLE = "cdc_relay_dead_letters"


class DeadLetterStore(Protocol):
    """Where the stream's culprit goes with ``--dead-letter-topic``: a stage the stream takes
    (cdc_relay.relay.stages.OpenDeadLetters makes one); ``DeadLetters`` is the real one."""

    @property
    def topic(self) -> str:
        """The dead-letter topic."""

    def check(self, conn: psycopg.Connection[dict[str, Any]]) -> None:
        """Raise PreflightError when the store cannot be written (at start)."""

    def store(self, message: Message, err: KafkaError) -> None:
        """Keep the event with its content before the slot moves past it."""

    def letter(self, message: Message, err: KafkaError, with_value: bool) -> Message:
        """The dead-letter message for ``message``, with its payload or without."""

    def close(self) -> None:
        """Release what it holds."""


class DeadLetters:
    """Stores refused events and builds their dead-letter messages."""

    def __init__(self, dsn: str, slot: str, topic: str) -> None:
        self._dsn = dsn
        self._slot = slot
        self.topic = topic
        self._conn: psycopg.Connection[dict[str, Any]] | None = None

    def check(self, conn: psycopg.Connection[dict[str, Any]]) -> None:
        """The table exists and the relay's role may write it."""
        row = conn.execute(QUERIES["dead_letter_table"]).fetchone()
        if not row or not row["writable"]:
            raise PreflightError(
                f"--dead-letter-topic keeps each dead letter's content in table {TABLE}, which "
                "is missing or not writable by this role; run cdc-relay schema apply outbox (and "
                "grant what cdc-relay schema show roles grants, for a least-privilege role)"
            )
        if not row["current"]:
            raise PreflightError(
                f"table {TABLE} is of an older schema outbox, which keeps one event per id (two "
                "events of one id, from two tables, would keep the first one's content); run "
                "cdc-relay schema apply outbox, which keys it by content too"
            )

    def store(self, message: Message, err: KafkaError) -> None:
        """Keep the event with its content; raises ConnectionLost when the database is away
        (the stream then replays, and the event is refused and stored again)."""
        headers = {name: value.decode(errors="replace") for name, value in message.headers}
        params = {
            "event_id": headers.get("id", "?"),
            "topic": message.topic,
            "key": message.key,
            "value": message.value,
            "headers": json.dumps(headers),
            "error_code": str(err.name()),
            "error": err.str(),
            "commit_lsn": format_lsn(message.lsn),
            "slot": self._slot,
            "content_sha256": content_sha256(message),
        }
        try:
            if self._conn is None or self._conn.closed:
                self._conn = psycopg.connect(self._dsn, autocommit=True, row_factory=dict_row)
            self._conn.execute(QUERIES["store_dead_letter"], params)
        except psycopg.OperationalError as exc:
            self._conn = None
            raise ConnectionLost(f"cannot store a dead letter: {exc}") from None

    def letter(self, message: Message, err: KafkaError, with_value: bool) -> Message:
        """The dead-letter message: the event's key and headers, the reason in more headers,
        and its payload unless ``with_value`` is False (the payload stays in the table)."""
        size = len(message.value) if message.value is not None else 0
        return Message(
            topic=self.topic,
            key=message.key,
            value=message.value if with_value else None,
            headers=[
                *message.headers,
                ("error", err.str().encode()),
                ("error_code", str(err.name()).encode()),
                ("original_topic", message.topic.encode()),
                ("payload_bytes", str(size).encode()),
                ("payload_in", (b"value " if with_value else b"") + TABLE.encode()),
            ],
            lsn=message.lsn,
        )

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


def content_sha256(message: Message) -> bytes:
    """What tells two dead letters of one id apart (events of two tables may share an id) and
    a dead letter stored again the same: the SHA-256 of its topic, key, value and headers."""
    content = [
        message.topic,
        None if message.key is None else message.key.hex(),
        None if message.value is None else message.value.hex(),
        [[name, value.hex()] for name, value in message.headers],
    ]
    return hashlib.sha256(json.dumps(content).encode()).digest()


# -- the poller's: rows parked in the outbox ------------------------------------------------


def dead_letters(dsn: str, table: str, limit: int) -> list[dict[str, Any]]:
    """The oldest ``limit`` dead letters."""
    with connect(dsn) as conn:
        outbox = resolve(conn, table)
        with refused(outbox, "the dead-letter query"):
            return store.dead_letters(conn, outbox, limit)


def retry_dead_letters(dsn: str, table: str, ids: Sequence[str] | None) -> list[str]:
    """Put dead letters (those of ``ids``, or all) back in the queue; wake the pollers.

    Returns the ids that were dead letters and are queued again.
    """
    with connect(dsn) as conn:
        outbox = resolve(conn, table)
        with refused(outbox, "the retry of dead letters"):
            return store.retry_dead_letters(conn, outbox, ids)


class DeadLetterRefusals:
    """The stream's refusal policy with ``--dead-letter-topic``: the culprit goes to the
    dead letters (the table, then the topic) and the stream goes on, and so does an event
    whose topic another aggregate type made first (routing.TopicTaken); everything else is
    the wrapped policy's (rewinds.Rewinds). ``deliver_alone`` is the pipeline's: each dead
    letter goes alone, under the culprit's token, so its acknowledgement moves the
    checkpointer past the event it stands for."""

    def __init__(
        self,
        policy: RefusalPolicy,
        store: DeadLetterStore,
        deliver_alone: Callable[[Message, Any], KafkaError | None],
    ) -> None:
        self.policy = policy
        self.store = store
        self._deliver_alone = deliver_alone

    def refused(self, token: Any, err: KafkaError) -> None:
        self.policy.refused(token, err)

    def served(self) -> None:
        self.policy.served()

    def retry(self, token: Any, err: KafkaError) -> None:
        self.policy.retry(token, err)

    def cleared(self, token: Any) -> None:
        self.policy.cleared(token)

    def unroutable(self, token: Any, exc: RelayError) -> None:
        if isinstance(exc, TopicTaken):  # its topic is another name's: set it aside
            self.culprit(exc.message, token, KafkaError(KafkaError.TOPIC_EXCEPTION, str(exc)))
        else:  # no message to set aside (no payload, no table)
            self.policy.unroutable(token, exc)

    def culprit(self, message: Message, token: Any, err: KafkaError) -> None:
        """Keep the event in the table, then send its dead letter: with the payload, or
        without when the payload is what the dead-letter topic refuses too."""
        self.policy.cleared(token)
        store = self.store
        store.store(message, err)
        letter_err = self._deliver_alone(store.letter(message, err, with_value=True), token)
        if letter_err is not None and is_culprit(letter_err) and message.value:
            # The payload is what the dead-letter topic refuses too: the table has it.
            letter_err = self._deliver_alone(store.letter(message, err, with_value=False), token)
        if letter_err is not None:
            raise DeliveryError(
                f"the dead-letter topic {store.topic} refused event {token[1]} too: "
                f"{letter_err.str()}; the event is in table {TABLE}, and nothing from it on "
                "was confirmed: fix the dead-letter topic and restart"
            )
        log_refusal(log.warning, "event sent to the dead-letter topic", message, err)
        count_failed("stream", header(message, "event_type"))
