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
quiet if its rate, weighed over the looks of the last ``SPAN`` or so (``Pace``), is under
``QUIET`` events/s. Then ``send_if_quiet`` asks librdkafka to send what it holds now: a
flush, which sends every batch at once for as long as it runs, of at most ``FLUSH``. A busy
stream is left to ``linger.ms``: its batches fill, and fewer, larger requests keep the
broker's work down where the machine is busiest (a ``linger.ms`` of 5 raised p99 at 20,000
events/s on two cores, bench/README.md). The flush serves delivery reports as a poll does, on
the loop's thread.

The rate over ``SPAN``, not a count nor the rate since the last look, tells a quiet stream: a
steady 5,000 events/s comes in bursts (a writer's commits are not evenly spaced), and judged
by 30 events in ``HOLD`` its p99 stayed at 14.0 to 15.3 ms; by the rate since the last look,
at 10.5 to 12.1; nor the events the producer holds, which include what waits for a broker
that answers one request at a time (p99 14.9 to 17.5 ms). Measured in bench/README.md.

Exactly once has no use for it: its commit sends what the transaction holds.
"""

from __future__ import annotations

from cdc_relay.relay.stages import Sink

HOLD = 0.003
"""Seconds the first event of a quiet stream waits for others to share its batches."""

FLUSH = 0.005
"""The longest the look's flush holds the loop. The producer's requests go one partition and
one at a time (above), and on a busy machine three of them took longer than ``HOLD`` now and
then: what a flush leaves waits out ``linger.ms``, and made the p99 once the rate was judged
right (bench/README.md)."""

QUIET = 10_000
"""Events per second under which a stream is quiet: between the 5,000 whose tail the look
shortens and the 20,000 whose batches should fill; also the most events the producer may
hold for a flush to be worth it (more is Kafka not answering, and the flush would only wait)."""

SPAN = 0.020
"""Seconds over which a look weighs the stream's rate. A writer's commits come in bursts, and
over a look's window alone (3 to 5 ms) a steady 5,000 events/s looked busy at 7.5% of the looks,
whose events then waited out ``linger.ms``: the p99. Over 20 ms, bursts average out, and a
stream that turns busy is known within a few looks. The price: a pause of ``SPAN`` or more is
quiet at its next look, but the first transaction after a shorter pause in a busy stretch
waits out ``linger.ms`` as a busy stream's do."""


class Pace:
    """The stream's rate as the loop's looks see it, averaged over about ``SPAN``: each look
    moves it toward the rate since the last look by the share of ``SPAN`` that time spans (an
    exponential moving average: a burst of n events adds at most n / ``SPAN``, and a pause of
    ``SPAN`` or more sets the rate anew). Each run of the loop starts one at 0 events/s, so after
    a start or a reconnect a busy stream's first looks (two, at 30,000 events/s) still flush."""

    __slots__ = ("at", "events", "rate")

    def __init__(self, events: int, now: float) -> None:
        self.events, self.at, self.rate = events, now, 0.0

    def quiet(self, events: int, now: float) -> bool:
        """A look at ``now``, ``events`` sent in all: whether the stream is quiet."""
        seconds = now - self.at
        if seconds > 0:
            weight = min(1.0, seconds / SPAN)
            self.rate += weight * ((events - self.events) / seconds - self.rate)
        self.events, self.at = events, now
        return self.rate < QUIET


def send_if_quiet(sink: Sink, pace: Pace, events: int, now: float) -> None:
    """The loop's look at a stream read to its end: send what the producer holds now if the
    stream is quiet, ``events`` sent in all by ``now``."""
    if pace.quiet(events, now) and 0 < sink.in_flight() < QUIET:
        sink.settle(FLUSH)
