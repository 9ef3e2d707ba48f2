"""Which build runs (cdc_relay/compiled.py): the same tests pass on the pure-Python package and
on the compiled one (make compiled-check), so these say what holds for both."""

from __future__ import annotations

from importlib import import_module
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from click.testing import CliRunner

import cdc_relay
from cdc_relay.commands.cli import cli
from cdc_relay.compiled import MODULES, build

PACKAGE = Path(cdc_relay.__file__).parent


def test_every_module_of_the_hot_path_is_a_module_of_the_package() -> None:
    for path in MODULES:
        assert (PACKAGE.parent / path).is_file(), path


def test_the_build_says_what_the_imported_modules_are() -> None:
    native = {
        path: (import_module(path.removesuffix(".py").replace("/", ".")).__file__ or "").endswith(
            tuple(EXTENSION_SUFFIXES)
        )
        for path in MODULES
    }
    expected = (
        "compiled (mypyc)"
        if all(native.values())
        else "partly compiled"
        if any(native.values())
        else "pure Python"
    )
    assert build() == expected


def test_version_names_the_build() -> None:
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0
    assert result.output == f"cdc-relay, version {cdc_relay.__version__}, {build()}\n"
