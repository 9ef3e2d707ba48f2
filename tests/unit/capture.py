"""Real pgoutput and wal2json messages captured from PostgreSQL 15 (tests/tools/capture.py)."""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).parent / "data"


def messages(plugin: str, step: str | None = None) -> list[bytes]:
    """The captured messages of ``plugin``, all or those of one workload step, in order."""
    lines = (DATA / f"{plugin}.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return [bytes.fromhex(r["hex"]) for r in records if step is None or r["step"] == step]


def pgoutput_messages(step: str | None = None) -> list[bytes]:
    return messages("pgoutput", step)
