"""The command's entry point (the console script and ``python -m cdc_relay``): stops are
deferred (``stops``) before the heavy imports of the commands."""

from __future__ import annotations

from cdc_relay.commands.stops import defer_stops


def main() -> None:
    """``cdc-relay``: stops are deferred before the heavy imports."""
    defer_stops()
    from cdc_relay.commands.cli import main as cli_main  # imported after defer_stops, on purpose

    cli_main()
