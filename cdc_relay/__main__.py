"""``python -m cdc_relay``: the same as the ``cdc-relay`` command."""

from __future__ import annotations

from cdc_relay.commands.startup import main

main()
