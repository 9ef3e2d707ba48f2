"""cdc-relay: transactional-outbox events from PostgreSQL to Kafka through logical replication."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    # Written at build time from git (setuptools-scm): a tag vX.Y.Z makes X.Y.Z.
    __version__ = version("cdc-relay")
except PackageNotFoundError:  # the sources on PYTHONPATH, never installed
    __version__ = "0.0.0+unknown"
