"""The release artifacts: ``make dist``'s wheel installed alone in a clean virtualenv (no
sources, no dev packages) runs its console script, ``schema show``, and a relay against the
test services."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version
from relaytools import Writer, check, consume

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel and sdist that ``make dist`` builds, in a folder of their own."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        # the test run's interpreter has what make install would set up: -o install skips it
        [
            "make",
            "--no-print-directory",
            "-o",
            "install",
            "dist",
            f"DIST={out}",
            f"PY={sys.executable}",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=600,
    )
    return out


@pytest.fixture(scope="module")
def installed(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean virtualenv with the wheel and its dependencies only: its bin folder."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    (wheel,) = dist.glob("cdc_relay-*.whl")
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(wheel)],
        check=True,
        timeout=600,
        env=_clean_env(),
    )
    return venv / "bin"


def _clean_env(**more: str) -> dict[str, str]:
    # Nothing of this checkout or of the test run's interpreter may leak into the virtualenv.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    return {**env, **more}


def _run(bin_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(bin_dir / "cdc-relay"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=bin_dir,  # not the checkout: its cdc_relay/ must not be what runs
        env=_clean_env(**env),
    )


def test_make_dist_builds_a_wheel_and_an_sdist_of_one_version(dist: Path) -> None:
    (wheel,) = dist.glob("cdc_relay-*-py3-none-any.whl")
    (sdist,) = dist.glob("cdc_relay-*.tar.gz")
    version = wheel.name.split("-")[1]
    assert sdist.name == f"cdc_relay-{version}.tar.gz"
    # From git, never the fallback of a tree without git metadata: a release tag's X.Y.Z on
    # a tagged commit, else a development version naming the commit (X.Y.(Z+1).devN+gHASH
    # after a tag, 0.0.1.devN+unknown.gHASH in a clone without tags).
    parsed = Version(version)
    head = _git("rev-parse", "HEAD")
    if parsed.local is None:
        assert f"v{version}" in _git("tag", "--points-at", "HEAD").split(), version
    else:
        assert parsed.is_devrelease, version
        assert re.search(rf"(^|\.)g{head[:7]}", parsed.local), (version, head)


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()


def test_the_installed_wheel_runs_its_console_script_and_schema_show(
    dist: Path, installed: Path
) -> None:
    version = next(dist.glob("cdc_relay-*.whl")).name.split("-")[1]
    shown = _run(installed, "--version")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == f"cdc-relay, version {version}, pure Python"
    # The package's own copy of the schema, read from the wheel's package data.
    schema = _run(installed, "schema", "show", "outbox")
    assert schema.returncode == 0, schema.stderr
    assert "CREATE TABLE" in schema.stdout
    assert "outbox_events" in schema.stdout
    where = subprocess.run(
        [str(installed / "python"), "-c", "import cdc_relay; print(cdc_relay.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=installed,
        env=_clean_env(),
    )
    assert where.stdout.startswith(str(installed.parent)), where.stdout


def test_the_installed_wheel_relays_events_to_kafka(
    installed: Path, outbox_db: str, kafka_service: Any, names: Any
) -> None:
    env = {
        "CDC_RELAY_DSN": outbox_db,
        "CDC_RELAY_SLOT": names.slot,
        "CDC_RELAY_PUBLICATION": names.publication,
        "CDC_RELAY_KAFKA_BOOTSTRAP": kafka_service.bootstrap,
        "CDC_RELAY_TOPIC_TEMPLATE": names.topic_prefix + ".{aggregate_type}",
        "CDC_RELAY_STATUS_INTERVAL": "1",
    }
    made = _run(installed, "setup-slot", **env)
    assert made.returncode == 0, made.stderr
    relay = subprocess.Popen(
        [str(installed / "cdc-relay"), "stream"],
        cwd=installed,
        env=_clean_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        writer = Writer(outbox_db)
        for i in range(50):
            writer.transaction([(("order", "invoice")[i % 2], f"a{i % 7}", {"i": i})])
        writer.close()
        received = consume(kafka_service.bootstrap, names.topic_prefix, expected=50)
        verdict = check(writer.written, received, names.topic_prefix)
        assert verdict.lost == []
        assert verdict.mismatched == []
        assert verdict.out_of_order == []
    finally:
        relay.terminate()
        output, _ = relay.communicate(timeout=60)
    assert relay.returncode == 0, output
