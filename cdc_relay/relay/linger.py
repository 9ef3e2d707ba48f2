"""A quiet stream's events go to Kafka without waiting out ``linger.ms``.

librdkafka holds each partition's batch open for ``linger.ms`` (10 ms, the relay's default) so
that a busy stream sends full batches. It sends one partition's batch per produce request, and
the relay's idempotent producer one request at a time to a broker (``max.in.flight=1``,
sink.py), so the last partition of a quiet stream waits ``linger.ms`` and then a round trip for
each partition before it: at 5,000 events/s, p99 was 11.6 to 15.5 ms (bench/README.md, "A quiet
stream does not wait out linger.ms").

So the stream loop notes when the first message since its last look came, and looks at its
first tick ``HOLD`` or more after it at which the relay has read all the server sent (a read
waits no longer than that; never in a backlog, nor in the middle of a burst). The stream is
quiet if the events sent since the last look came at under ``QUIET`` events/s (the time of
the look's own flush not counted). Then ``send_if_quiet`` asks librdkafka to send what it
holds now: a flush, which sends every batch at once for as long as it runs, of at most
``HOLD``. A busy stream is left to ``linger.ms``: its batches fill, and fewer, larger
requests keep the broker's work down where the machine is busiest (a ``linger.ms`` of 5
raised p99 at 20,000 events/s on two cores, bench/README.md). The flush serves delivery
reports as a poll does, on the loop's thread.

The rate, not a count, tells a quiet stream: a steady 5,000 events/s comes in bursts (a
writer's commits are not evenly spaced), and judged by 30 events in ``HOLD`` its p99 stayed at
14.0 to 15.3 ms, where judged by 50 it was 8.2 to 10.9 ms; nor the events the producer holds,
which include what waits for a broker that answers one request at a time (p99 14.9 to 17.5
ms). Measured in bench/README.md.

Exactly once has no use for it: its commit sends what the transaction holds.
"""

from __future__ import annotations

from cdc_relay.relay.stages import Sink

HOLD = 0.003
"""Seconds the first event of a quiet stream waits for others to share its batches, and the
longest the flush that then sends them holds the loop."""

QUIET = 10_000
"""Events per second under which a stream is quiet: between the 5,000 whose tail the look
shortens and the 20,000 whose batches should fill; also the most events the producer may
hold for a flush to be worth it (more is Kafka not answering, and the flush would only wait)."""


def quiet(sent: int, seconds: float) -> bool:
    """Whether a stream read to its end is quiet: ``sent`` events in the ``seconds`` since the
    loop's last look came at under ``QUIET`` a second."""
    return sent < QUIET * seconds


def send_if_quiet(sink: Sink, sent: int, seconds: float) -> None:
    """The loop's look at a stream read to its end: send what the producer holds now if
    ``sent`` events in ``seconds`` make it quiet."""
    if quiet(sent, seconds) and 0 < sink.in_flight() < QUIET:
        sink.settle(HOLD)
