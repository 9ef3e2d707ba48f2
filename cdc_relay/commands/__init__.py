"""The ``cdc-relay`` command: one module per command, each declaring its options and calling
the module that does the work; output formatting lives with the command that prints it.

``startup`` is the entry point (the console script and ``python -m cdc_relay``); ``cli`` the
group that registers the commands; ``options`` and ``kafka_options`` the options they share;
``stops`` and ``relays`` how a relay command stops.
"""
