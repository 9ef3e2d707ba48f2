"""Shards: PostgreSQL's hashtext in Python, against values captured from PostgreSQL, and the
names, rules and notes of shards and resharding cuts."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from cdc_relay.errors import UsageError
from cdc_relay.postgres.shards import Cut, Shard, StartAfterCut, every_shard, hashtext

CAPTURED = Path(__file__).parent / "data" / "hashtext.jsonl"


def captured() -> list[tuple[str, int]]:
    """(key, hashtext(key)) pairs PostgreSQL computed (the first line says which version)."""
    lines = CAPTURED.read_text(encoding="utf-8").splitlines()[1:]
    return [(row["key"], row["hashtext"]) for row in map(json.loads, lines)]


def test_hashtext_is_postgresqls_on_every_captured_key() -> None:
    pairs = captured()
    assert len(pairs) == 300
    # every tail length of the 12-byte blocks, and multi-byte UTF-8
    assert {len(key.encode()) % 12 for key, _ in pairs} == set(range(12))
    assert any(len(key.encode()) > len(key) for key, _ in pairs)
    assert [(key, hashtext(key.encode())) for key, _ in pairs] == pairs


def test_each_aggregate_id_has_exactly_one_shard_and_shards_share_the_keys() -> None:
    keys = [key for key, _ in captured()] + [f"order-{n}" for n in range(3000)]
    for count in (1, 2, 3, 7):
        owners = Counter()
        for key in keys:
            (owner,) = [shard for shard in every_shard(count) if shard.owns(key)]
            owners[owner.index] += 1
        assert sorted(owners) == list(range(count))
        assert min(owners.values()) > len(keys) / count / 2  # roughly even
    # NULL and the empty id are one and the same shard's
    assert all(shard.owns(None) == shard.owns("") for shard in every_shard(5))


def test_shard_parse_names_and_refusals() -> None:
    shard = Shard.parse(" 1 / 4 ")
    assert (shard.index, shard.count, str(shard)) == (1, 4, "1/4")
    assert shard.name("cdc_relay") == "cdc_relay_1of4"
    for text in ("4/4", "-1/2", "1", "a/b", "1/0", "0/257", ""):
        with pytest.raises(UsageError, match="K/N"):
            Shard.parse(text)


def test_cut_and_start_after_cut_round_trip() -> None:
    cut = Cut("0f8fad5b-d9cb-469f-a165-70867728950e", ("s_0of2", "s_1of2"))
    assert Cut.from_content(cut.content().encode()) == cut
    assert Cut.from_content(b"not json") is None
    assert Cut.from_content(b'{"cut": "x"}') is None
    shard = Shard(2, 3)
    waiting = StartAfterCut(cut.cut, None)
    assert StartAfterCut.from_comment(waiting.comment(shard), shard) == waiting
    placed = StartAfterCut(cut.cut, 0x1_2345_6789)
    assert placed.comment(shard).endswith("whose message is at 1/23456789")
    assert StartAfterCut.from_comment(placed.comment(shard), shard) == placed
    # another shard's note, or none, is not this shard's
    assert StartAfterCut.from_comment(placed.comment(shard), Shard(1, 3)) is None
    assert StartAfterCut.from_comment(None, shard) is None
    assert StartAfterCut.from_comment("a comment of someone else's", shard) is None
