"""The benchmark harness of cdc-relay: ``python -m bench.run --help`` (``make bench``)."""
