"""The hot path that a compiled build turns into native code, and which build runs.

``CDC_RELAY_COMPILE=1`` at build time (``make dist-compiled``, setup.py) compiles the modules
of MODULES with mypyc: the same typed source that ``mypy --strict`` checks, so the pure-Python
package and the compiled one are one source. Without it (a plain ``pip install``, an sdist on a
machine without a compiler) the package is pure Python and behaves the same, only slower.
"""

from __future__ import annotations

from importlib.machinery import EXTENSION_SUFFIXES
from importlib.util import find_spec

MODULES = (
    "cdc_relay/lsn.py",
    "cdc_relay/events.py",
    "cdc_relay/postgres/pgoutput.py",
    "cdc_relay/postgres/replication.py",
    "cdc_relay/kafka/routing.py",
    "cdc_relay/kafka/sink.py",
    "cdc_relay/relay/lsn_tracker.py",
    "cdc_relay/relay/records.py",
    "cdc_relay/relay/batch.py",
    "cdc_relay/relay/pipeline.py",
    "cdc_relay/relay/reading.py",
)
"""Every event passes through these: reading the replication stream, decoding, mapping, routing,
the pipeline's per-event work, the Kafka sink's produce and delivery report, and the LSN
tracker. The loop around them (relay/stream.py) runs once per tick of a few milliseconds, not
per message (reading.py), and stays Python (measured: bench/README.md, "Compiled")."""


def build() -> str:
    """``compiled (mypyc)`` when every module of MODULES runs as native code, ``pure Python``
    when none does, ``partly compiled`` otherwise (a build that lost some of its modules)."""
    native = [_is_extension(path) for path in MODULES]
    if all(native):
        return "compiled (mypyc)"
    return "partly compiled" if any(native) else "pure Python"


def _is_extension(path: str) -> bool:
    spec = find_spec(path.removesuffix(".py").replace("/", "."))
    origin = spec.origin if spec is not None else None
    return origin is not None and origin.endswith(tuple(EXTENSION_SUFFIXES))
