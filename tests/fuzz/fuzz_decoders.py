"""Coverage-guided fuzzing of the pgoutput and wal2json decoders (atheris, i.e. libFuzzer).

The property is the unit tests' (tests/unit/test_decoder_properties.py): a decoder returns
well-formed records or raises DecodeError; any other exception is a crash, and libFuzzer stops
and writes the input that caused it. The corpus starts from the messages captured from
PostgreSQL 15 (tests/unit/data); wal2json inputs are also mutated as JSON documents, a value
swapped for another, so that the fuzzer gets past the JSON parser.

    python tests/fuzz/fuzz_decoders.py --seconds 600          # both decoders, 300 s each
    python tests/fuzz/fuzz_decoders.py --seconds 60 wal2json  # one decoder
    python tests/fuzz/fuzz_decoders.py wal2json -runs=1000     # with libFuzzer's options

The run is one process at a time. Corpus and crash inputs go under --workdir (a new temporary
directory unless given); the summary gives the inputs tried per decoder.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import atheris

with atheris.instrument_imports(include=["cdc_relay"]):
    from cdc_relay.postgres import pgoutput
    from cdc_relay.postgres.wal2json import Wal2JsonDecoder

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from capture import messages
from test_decoder_properties import decodes_or_refuses

DECODERS = ("pgoutput", "wal2json")
MAX_LEN = 8192  # the largest captured message (a TOASTed payload) is 7,367 bytes

# libFuzzer dictionaries: tokens its mutations insert.
TOKENS = {
    "pgoutput": [c.encode() for c in "BCRIUDTOYMNKOtbnu"]
    + [b"\x00\x00\x00\x00", b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff", b"\x00\x00", b"\xff\xff"],
    "wal2json": [
        f'"{word}"'.encode()
        for word in "action xid timestamp lsn nextlsn schema table columns name type typeoid "
        "value transactional prefix content B C I M U D T".split()
    ]
    + [b"true", b"false", b"null", b'"0/0"', b'"\\ud800"', b'"\\u00b2"', b"[", b"{", b"}"],
}

# Values the JSON mutator swaps in: edge cases of each field's type.
JSON_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    4294967296,
    1.5,
    "",
    "0",
    "\u00b2",
    "\u0663",
    "\ud800",
    "9" * 4400,
    "0/0",
    "FFFFFFFF/FFFFFFFF",
    "0/",
    "1969-12-31 23:59:59.5+00",
    "9999-12-31 23:59:59.999999-15",
    "2026-01-01 00:00:00",
    [],
    {},
    [{"name": "a"}],
    {"name": "a", "typeoid": "25", "value": "v"},
]


def pgoutput_one(data: bytes) -> None:
    decodes_or_refuses(lambda m: (pgoutput.decode(m),), data)


def wal2json_one(data: bytes) -> None:
    decodes_or_refuses(Wal2JsonDecoder().decode, data)


def mutate_wal2json(data: bytes, max_size: int, seed: int) -> bytes:
    """Half the time libFuzzer's byte mutations; otherwise a JSON-level edit of the document."""
    rng = random.Random(seed)
    if rng.random() < 0.5:
        return atheris.Mutate(data, max_size)
    try:
        document = json.loads(data)
    except (ValueError, RecursionError):
        return atheris.Mutate(data, max_size)
    containers: list[Any] = []
    values: list[Any] = []

    def walk(node: Any) -> None:
        values.append(node)
        if isinstance(node, dict | list) and node:
            containers.append(node)
            for child in node.values() if isinstance(node, dict) else node:
                walk(child)

    walk(document)
    if not containers:
        return atheris.Mutate(data, max_size)
    node = rng.choice(containers)
    key = rng.choice(list(node) if isinstance(node, dict) else range(len(node)))
    choice = rng.random()
    if choice < 0.15:
        del node[key]
    elif choice < 0.3:
        node[key] = copy.deepcopy(rng.choice(values))  # from elsewhere, maybe an ancestor
    elif choice < 0.45:
        node[key] = "".join(chr(rng.randrange(0x110000)) for _ in range(rng.randrange(1, 8)))
    else:
        node[key] = rng.choice(JSON_VALUES)
    out = json.dumps(document, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")
    return out[:max_size]


def fuzz(decoder: str, seconds: int, workdir: Path, libfuzzer_args: list[str]) -> None:
    """Run libFuzzer on one decoder in this process; it exits when done."""
    corpus = workdir / decoder / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for i, message in enumerate(messages(decoder)):
        (corpus / f"captured-{i:03}").write_bytes(message)
    tokens = workdir / decoder / "tokens.dict"
    tokens.write_text("".join(f'"{_escape(token)}"\n' for token in TOKENS[decoder]))
    args = [
        sys.argv[0],
        f"-max_total_time={seconds}",
        f"-max_len={MAX_LEN}",
        "-timeout=10",
        "-print_final_stats=1",
        f"-dict={tokens}",
        f"-artifact_prefix={workdir / decoder}/",
        *libfuzzer_args,
        str(corpus),
    ]
    one: Callable[[bytes], None] = pgoutput_one if decoder == "pgoutput" else wal2json_one
    if decoder == "wal2json":
        atheris.Setup(args, one, custom_mutator=mutate_wal2json)
    else:
        atheris.Setup(args, one)
    atheris.Fuzz()


def _escape(token: bytes) -> str:
    return "".join(chr(b) if 32 <= b < 127 and b not in b'"\\' else f"\\x{b:02x}" for b in token)


def run_all(decoders: list[str], seconds: int, workdir: Path, libfuzzer_args: list[str]) -> int:
    """Fuzz each decoder in turn, in a child process, and sum up what libFuzzer reports."""
    share = max(1, seconds // len(decoders))
    rows = []
    for decoder in decoders:
        command = [sys.executable, __file__, "--child", "--seconds", str(share)]
        command += ["--workdir", str(workdir), decoder, *libfuzzer_args]
        started = time.monotonic()
        output = []
        with subprocess.Popen(command, stderr=subprocess.PIPE, text=True, errors="replace") as p:
            assert p.stderr is not None
            for line in p.stderr:
                sys.stderr.write(line)
                output.append(line)
        elapsed = time.monotonic() - started
        text = "".join(output)
        runs = re.findall(r"stat::number_of_executed_units: (\d+)", text)
        crashed = "Uncaught Python exception" in text or p.returncode != 0
        crash_files = sorted(str(f) for f in (workdir / decoder).glob("crash-*"))
        rows.append((decoder, int(runs[-1]) if runs else None, elapsed, crashed, crash_files))
    print(f"\nfuzz summary (workdir {workdir}):")
    for decoder, runs, elapsed, crashed, crash_files in rows:
        tried = "?" if runs is None else f"{runs:,}"
        found = "CRASH " + " ".join(crash_files) if crashed else "only DecodeError or records"
        print(f"  {decoder:9} {tried:>12} inputs in {elapsed:5.0f} s: {found}")
    return 1 if any(row[3] for row in rows) else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("decoders", nargs="*", metavar="{pgoutput,wal2json}")
    parser.add_argument("--seconds", type=int, default=600, help="in all, shared by decoders")
    parser.add_argument("--workdir", type=Path, help="corpus and crash inputs (default: new)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args, libfuzzer_args = parser.parse_known_args()
    if unknown := set(args.decoders) - set(DECODERS):
        parser.error(f"no decoder {', '.join(sorted(unknown))}; choose from {', '.join(DECODERS)}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="cdc-relay-fuzz-"))
    if args.child:
        fuzz(args.decoders[0], args.seconds, workdir, libfuzzer_args)
    sys.exit(run_all(args.decoders or list(DECODERS), args.seconds, workdir, libfuzzer_args))


if __name__ == "__main__":
    main()
