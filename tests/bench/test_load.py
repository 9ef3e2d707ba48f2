"""The load check and what makes a run full: pure functions, no services."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import load, run

QUIET = (0.5, 0.7, 0.9)
BUSY = (3.11, 2.0, 1.5)
COMMAND = "python -m bench.run --profile"


def test_a_quiet_machine_runs_anything() -> None:
    verdict = load.check(QUIET, ["backlog of 1,000,000 events"], False, COMMAND)
    assert verdict == load.Verdict(go=True, noisy=False, message=None)


def test_a_load_of_exactly_the_limit_is_quiet() -> None:
    assert load.check((load.QUIET, 9.0, 9.0), ["x"], False, COMMAND).noisy is False


def test_a_busy_machine_refuses_a_full_run_in_one_line_that_says_how_to_override() -> None:
    verdict = load.check(BUSY, ["backlog of 1,000,000 events"], False, COMMAND)
    assert not verdict.go
    assert verdict.noisy
    assert verdict.message is not None
    assert "\n" not in verdict.message
    assert "3.11" in verdict.message
    assert "backlog of 1,000,000 events" in verdict.message
    assert f"`{COMMAND} --allow-noisy`" in verdict.message


def test_allow_noisy_runs_a_full_run_on_a_busy_machine_reported_noisy() -> None:
    verdict = load.check(BUSY, ["steady measured for 60 s"], True, COMMAND)
    assert verdict.go
    assert verdict.noisy
    assert verdict.message is not None
    assert verdict.message.startswith("warning")


def test_a_small_run_goes_on_on_a_busy_machine_with_a_warning() -> None:
    verdict = load.check(BUSY, [], False, COMMAND)
    assert verdict.go
    assert verdict.noisy
    assert verdict.message is not None
    assert verdict.message.startswith("warning")


def test_an_unknown_load_is_not_called_noisy_nor_quiet() -> None:
    verdict = load.check(None, ["x"], False, COMMAND)
    assert verdict.go
    assert verdict.noisy is None
    assert load.text(None) == "unknown"


def test_the_load_is_read_as_three_figures() -> None:
    figures = load.read()
    assert figures is not None
    assert len(figures) == 3
    assert len(load.text(figures).split()) == 3


def _full(*argv: str) -> list[str]:
    return run.full_run(run._parse(list(argv)))


def test_the_defaults_are_a_full_run() -> None:
    assert _full() == [
        "backlog of 1,000,000 events",
        "steady, steady-high measured for 60 s",
    ]
    assert "profile on a backlog of 200,000 events" in _full("--profile")


@pytest.mark.parametrize(
    "argv",
    [
        ("--contestants=stream", "--workloads=backlog"),
        ("--workloads=steady-high",),
        ("--events=2000000", "--duration=5"),
        ("--workloads=steady", "--duration=5", "--profile"),
    ],
)
def test_any_measurement_at_full_size_makes_a_full_run(argv: tuple[str, ...]) -> None:
    assert _full(*argv)


@pytest.mark.parametrize(
    "argv",
    [
        ("--events=20000", "--duration=10"),
        ("--events=2000", "--duration=5", "--workloads=backlog", "--allow-noisy"),
        ("--workloads=backlog", "--events=2000"),  # the steady duration does not apply
        ("--workloads=steady", "--duration=5"),  # nor does the backlog's size
        ("--events=2000", "--rate=500", "--duration=2", "--profile", "--profile-events=2000"),
        ("--events=100000", "--duration=59", "--profile"),
    ],
)
def test_smaller_sizes_make_a_small_run(argv: tuple[str, ...]) -> None:
    assert _full(*argv) == []


def test_an_unknown_workload_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run._parse(["--workloads=steady,steady-20k"])
    assert "choose from backlog, steady, steady-high" in capsys.readouterr().err


def test_a_refused_run_starts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(load, "read", lambda: BUSY)
    assert run.main([f"--out={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "--allow-noisy" in err
    assert list(tmp_path.iterdir()) == []
