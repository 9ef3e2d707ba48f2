"""A quiet stream's events go to Kafka without waiting out ``linger.ms``.

librdkafka holds each partition's batch open for ``linger.ms`` (10 ms, the relay's default) so
that a busy stream sends full batches. It sends one partition's batch per produce request, and
the relay's idempotent producer one request at a time to a broker (``max.in.flight=1``,
sink.py), so the last partition of a quiet stream waits ``linger.ms`` and then a round trip for
each partition before it: at 5,000 events/s, p99 was 11.6 to 12.4 ms (bench/README.md, "A quiet
stream does not wait out linger.ms").

So the stream loop (stream.py) notes when the first message since its last look came, and
looks ``HOLD`` later, or at its next tick if that comes first. If the producer then holds
fewer than ``QUIET`` events, a stream under about 10,000 events/s, ``send_if_quiet`` asks
librdkafka to send them now: a flush, which sends every batch at once for as long as it runs,
of at most ``HOLD``. A busy stream is left to ``linger.ms``: its batches fill, and fewer, larger
requests keep the broker's work down where the machine is busiest (a ``linger.ms`` of 5 raised
p99 at 20,000 events/s on two cores, bench/README.md). The flush serves delivery reports as a
poll does, on the loop's thread.

Exactly once has no use for it: its commit sends what the transaction holds.
"""

from __future__ import annotations

from cdc_relay.relay.stages import Sink

HOLD = 0.003
"""Seconds the first event of a quiet stream waits for others to share its batches, and the
longest the flush that then sends them holds the loop."""

QUIET = 30
"""Fewer events than this held after ``HOLD`` make a quiet stream: 10,000 events/s."""


def send_if_quiet(sink: Sink) -> None:
    """Send what the producer holds now if it is little (the loop's look, ``HOLD`` after the
    first message since the last one)."""
    if sink.in_flight() < QUIET:
        sink.settle(HOLD)
