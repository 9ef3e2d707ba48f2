"""The stream relay's refusal policy (pipeline.RefusalPolicy; cdc_relay.kafka.refusals says
which refusal is whose): a refusal among others rewinds the stream to its confirmed position
and makes its event a suspect, sent alone on the replay; the culprit stops the relay with one
line (``--dead-letter-topic`` wraps this policy: deadletter.DeadLetterRefusals). The rewind
itself is the relay's (StreamRelay.rewind)."""

from __future__ import annotations

from confluent_kafka import KafkaError

from cdc_relay.errors import DeliveryError, RelayError
from cdc_relay.kafka.refusals import Fate, fate, refusal_error
from cdc_relay.kafka.routing import Message
from cdc_relay.relay.lsn_tracker import Transaction
from cdc_relay.relay.pipeline import Rewind

# A token of the sink: the event's transaction, and its id for the refusals.
Token = tuple[Transaction, str]


class Rewinds:
    """The stream's refusal policy (pipeline.RefusalPolicy; cdc_relay.kafka.refusals).

    A refusal among others makes its event a suspect and rewinds the stream: the relay
    replays from the confirmed position (nothing after a refused batch got through: the
    gapless guarantee) and sends each suspect alone. The culprit stops the relay, with one
    line; ``--dead-letter-topic`` wraps this policy (deadletter.DeadLetterRefusals) and
    dead-letters it instead.
    """

    def __init__(self) -> None:
        self.pending: list[tuple[Token, KafkaError]] = []  # reported since the last rewind
        self.suspects: set[str] = set()  # ids of the events to send alone
        self.rewinds = 0  # rewinds in a row that were retries, for the pause before the next
        self.pause_next = False  # a suspect sent alone met an error not about it: pause first

    def refused(self, token: Token, err: KafkaError) -> None:
        if not token[0].forgotten:
            self.pending.append((token, err))

    def served(self) -> None:
        if self.pending:
            raise Rewind

    def culprit(self, message: Message, token: Token, err: KafkaError) -> None:
        self.cleared(token)
        raise refusal_error(message, err, "stream")

    def retry(self, token: Token, err: KafkaError) -> None:
        self.pending.append((token, err))
        self.pause_next = True
        raise Rewind

    def cleared(self, token: Token) -> None:
        self.suspects.discard(token[1])
        self.rewinds = 0

    def unroutable(self, token: Token, exc: RelayError) -> None:
        raise exc  # a row or message of the outbox the relay cannot route: the user's to fix

    def note(self) -> bool:
        """Turn the refusals reported so far into suspects; True if one calls for a pause."""
        refusals, self.pending = self.pending, []
        retry = False
        for (_, event_id), err in refusals:
            kind = fate(err)
            if kind is Fate.STOP:
                raise DeliveryError(
                    f"Kafka refused the relay: {err.str()}; fix the cause and restart the relay: "
                    "it resumes after the last event Kafka acknowledged"
                )
            if kind is Fate.ISOLATE:
                self.suspects.add(event_id)
            else:
                retry = True
        return retry
