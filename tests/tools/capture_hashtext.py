"""Capture PostgreSQL's hashtext() of a set of keys for the shards' unit tests.

    python tests/tools/capture_hashtext.py "host=... dbname=..." tests/unit/data/hashtext.jsonl

Keys of every length modulo 12 (hashtext works on 12-byte blocks), non-ASCII ones among them;
the first line names the server the values came from.
"""

from __future__ import annotations

import json
import random
import sys

import psycopg

FIXED = [
    "", "a", "ab", "abc", "abcd", "abcde", "abcdefgh", "abcdefghi", "abcdefghijk",
    "abcdefghijkl", "abcdefghijklm", "order-42", "00000000-0000-0000-0000-000000000000",
    "Zoë ✓ 😀", "x" * 100,
]  # fmt: skip
ALPHABETS = [(0x20, 0x7E), (0xA0, 0x2FF), (0x4E00, 0x9FFF), (0x1F300, 0x1F64F)]


def main(dsn: str, out: str, count: int = 300) -> None:
    rnd = random.Random(7)
    keys = list(FIXED)
    while len(keys) < count:
        low, high = rnd.choice(ALPHABETS)
        keys.append("".join(chr(rnd.randint(low, high)) for _ in range(rnd.randint(1, 30))))
    with psycopg.connect(dsn) as conn:
        (version,) = conn.execute("SELECT version()").fetchone() or ("?",)
        rows = conn.execute(
            "SELECT k, hashtext(k) FROM unnest(%s::text[]) WITH ORDINALITY AS u(k, n) ORDER BY n",
            (keys,),
        ).fetchall()
    with open(out, "w", encoding="utf-8") as f:
        header = {"captured_from": str(version).split(" on ")[0], "query": "SELECT k, hashtext(k)"}
        f.write(json.dumps(header) + "\n")
        for key, value in rows:
            f.write(json.dumps({"key": key, "hashtext": value}, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
