"""``python -m cdc_relay``: the same as the ``cdc-relay`` command."""

from __future__ import annotations

from cdc_relay.startup import main

main()
