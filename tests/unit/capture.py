"""Real pgoutput messages captured from PostgreSQL 15 (tests/tools/capture_pgoutput.py)."""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).parent / "data"


def pgoutput_messages(step: str | None = None) -> list[bytes]:
    """The captured messages, all or those of one workload step, in stream order."""
    lines = (DATA / "pgoutput.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return [bytes.fromhex(r["hex"]) for r in records if step is None or r["step"] == step]
