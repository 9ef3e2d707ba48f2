"""Shards: one outbox served by N relays, each with its own slot and publication.

Shard K of N takes the events whose aggregate id hashes to K: ``hashtext(id) & 0x7fffffff``
modulo N, the text form of the id hashed by PostgreSQL's ``hashtext`` (NULL as the empty
string, so every event without an aggregate id goes to one shard). Rows are sorted out by the
publication's row filter (PostgreSQL 15), in the walsender; logical decoding messages pass
every publication, so each relay keeps its own by the same hash, computed here
(:func:`hashtext`, tested against PostgreSQL on 100,000 keys). All the events of an aggregate
go through one relay, so their order holds.

Resharding from N to M shards cuts every stream at one point: the new slots are created first,
then one transaction emits a cut message (:data:`CUT_PREFIX`) that every slot, old and new,
decodes at the same place among the transactions, since all decode the same WAL in commit
order. An old shard delivers what comes before the cut and stops at it; a new shard skips
what comes before it (the old shards deliver that), confirms nothing until it has passed it,
and waits at it for the old shards to be done. So no event is lost, none is published twice,
and none overtakes an earlier one of its aggregate (ARCHITECTURE.md, "Shards and
resharding").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from psycopg import sql

from cdc_relay.errors import UsageError
from cdc_relay.lsn import format_lsn

MAX_SHARDS = 256
CUT_PREFIX = "cdc-relay-cut"
"""The prefix of the logical decoding message that marks a resharding cut."""
_CUT_COMMENT = re.compile(
    r"cdc-relay: shard (\d+)/(\d+) starts after cut ([0-9a-f-]+)"
    r"(?:, whose message is at ([0-9A-F]+)/([0-9A-F]+))?"
)


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count``."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not 1 <= self.count <= MAX_SHARDS or not 0 <= self.index < self.count:
            raise UsageError(
                f"shard {self.index}/{self.count}: write K/N with 0 <= K < N <= {MAX_SHARDS}"
            )

    @classmethod
    def parse(cls, text: str) -> Shard:
        """``K/N``, as ``--shard`` takes it."""
        match = re.fullmatch(r"\s*(\d{1,4})\s*/\s*(\d{1,4})\s*", text)
        if not match:
            raise UsageError(f"--shard {text!r}: write K/N, e.g. --shard 0/4 for the first of 4")
        return cls(int(match[1]), int(match[2]))

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def name(self, base: str) -> str:
        """The slot or publication of this shard, for the base name ``--slot``/``--publication``
        gives: ``cdc_relay_1of4``. Shards of another count have other names, so the slots of
        two generations live side by side while resharding."""
        return f"{base}_{self.index}of{self.count}"

    def owns(self, aggregate_id: str | None) -> bool:
        """Whether an event with this aggregate id is this shard's (the publication's rule)."""
        key = (aggregate_id or "").encode()
        return (hashtext(key) & 0x7FFFFFFF) % self.count == self.index

    def row_filter(self, column: str) -> sql.Composable:
        """The publication's ``WHERE``: the same rule as :meth:`owns`, on ``column``."""
        return sql.SQL(
            "((hashtext(COALESCE(({column})::text, ''::text)) & 2147483647) % {count}) = {index}"
        ).format(
            column=sql.Identifier(column),
            count=sql.Literal(self.count),
            index=sql.Literal(self.index),
        )


def every_shard(count: int) -> list[Shard]:
    """Every shard of ``count``."""
    return [Shard(index, count) for index in range(count)]


@dataclass(frozen=True)
class Cut:
    """A resharding cut: its id, and the slots that stop at it (the old shards')."""

    cut: str
    slots: tuple[str, ...]

    def content(self) -> str:
        return json.dumps({"cut": self.cut, "slots": list(self.slots)})

    @classmethod
    def from_content(cls, content: bytes) -> Cut | None:
        """The cut a message of :data:`CUT_PREFIX` holds; None if it is not one."""
        try:
            fields = json.loads(content)
            return cls(str(fields["cut"]), tuple(str(slot) for slot in fields["slots"]))
        except (ValueError, KeyError, TypeError):
            return None


@dataclass(frozen=True)
class StartAfterCut:
    """Where a new shard starts, as ``reshard`` notes it in the comment of the shard's
    publication: after cut ``cut``, whose message is at ``lsn`` once it is written (None
    before). A slot confirmed past that position has passed the cut: a new shard confirms
    nothing before it has."""

    cut: str
    lsn: int | None

    def comment(self, shard: Shard) -> str:
        where = "" if self.lsn is None else f", whose message is at {format_lsn(self.lsn)}"
        return f"cdc-relay: shard {shard} starts after cut {self.cut}{where}"

    @classmethod
    def from_comment(cls, comment: str | None, shard: Shard) -> StartAfterCut | None:
        """Where ``shard`` starts, from its publication's comment; None if it names no cut
        or another shard."""
        found = cls.of_comment(comment)
        return found[1] if found is not None and found[0] == shard else None

    @classmethod
    def of_comment(cls, comment: str | None) -> tuple[Shard, StartAfterCut] | None:
        """The shard a publication's comment is written for, and where it starts; None if
        the comment names no cut."""
        match = _CUT_COMMENT.fullmatch(comment or "")
        if not match:
            return None
        try:
            shard = Shard(int(match[1]), int(match[2]))
        except UsageError:
            return None
        lsn = (int(match[4], 16) << 32) | int(match[5], 16) if match[4] else None
        return shard, cls(match[3], lsn)


def shard_named(name: str, base: str) -> Shard | None:
    """The shard whose slot or publication ``name`` is, of the base name ``base``
    (:meth:`Shard.name` read back); None for another name."""
    match = re.fullmatch(re.escape(base) + r"_(\d{1,4})of(\d{1,4})", name)
    if not match:
        return None
    try:
        shard = Shard(int(match[1]), int(match[2]))
    except UsageError:
        return None
    return shard if shard.name(base) == name else None  # no leading zeros


# -- PostgreSQL's hashtext ---------------------------------------------------------------------

_MASK = 0xFFFFFFFF


def _rot(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & _MASK


def hashtext(data: bytes) -> int:
    """PostgreSQL's ``hashtext`` of text whose bytes (UTF-8) are ``data``, as a signed 32-bit
    integer: ``hash_bytes`` of src/common/hashfn.c (Bob Jenkins' lookup3, as PostgreSQL adapted
    it), on a little-endian server. (It is what ``hashtext`` computes for a deterministic
    collation, which the default collations are.)"""
    length = len(data)
    a = b = c = (0x9E3779B9 + length + 3923095) & _MASK
    pos = 0
    while length - pos >= 12:
        a = (a + int.from_bytes(data[pos : pos + 4], "little")) & _MASK
        b = (b + int.from_bytes(data[pos + 4 : pos + 8], "little")) & _MASK
        c = (c + int.from_bytes(data[pos + 8 : pos + 12], "little")) & _MASK
        a, b, c = _mix(a, b, c)
        pos += 12
    tail = data[pos:]
    # The last 0-11 bytes: a takes bytes 0-3, b 4-7, c 8-10 shifted one byte up (its lowest
    # byte is left for the length, which the initial state already holds).
    a = (a + int.from_bytes(tail[0:4], "little")) & _MASK
    b = (b + int.from_bytes(tail[4:8], "little")) & _MASK
    c = (c + (int.from_bytes(tail[8:11], "little") << 8)) & _MASK
    c = _final(a, b, c)
    return c - (1 << 32) if c & 0x80000000 else c


def _mix(a: int, b: int, c: int) -> tuple[int, int, int]:
    a = ((a - c) & _MASK) ^ _rot(c, 4)
    c = (c + b) & _MASK
    b = ((b - a) & _MASK) ^ _rot(a, 6)
    a = (a + c) & _MASK
    c = ((c - b) & _MASK) ^ _rot(b, 8)
    b = (b + a) & _MASK
    a = ((a - c) & _MASK) ^ _rot(c, 16)
    c = (c + b) & _MASK
    b = ((b - a) & _MASK) ^ _rot(a, 19)
    a = (a + c) & _MASK
    c = ((c - b) & _MASK) ^ _rot(b, 4)
    b = (b + a) & _MASK
    return a, b, c


def _final(a: int, b: int, c: int) -> int:
    c = ((c ^ b) - _rot(b, 14)) & _MASK
    a = ((a ^ c) - _rot(c, 11)) & _MASK
    b = ((b ^ a) - _rot(a, 25)) & _MASK
    c = ((c ^ b) - _rot(b, 16)) & _MASK
    a = ((a ^ c) - _rot(c, 4)) & _MASK
    b = ((b ^ a) - _rot(a, 14)) & _MASK
    c = ((c ^ b) - _rot(b, 24)) & _MASK
    return c
