"""The process title: a password given on the command line is hidden from the process list
at start-up, with a warning that says where to give it instead."""

from __future__ import annotations

import click
import setproctitle

from cdc_relay.config import SAFER_PLACES, hide_passwords


def hide_passwords_from_the_process_list(argv: list[str]) -> None:
    """Rewrite the process title when ``argv`` carries a password, with ``***`` for it, and
    warn: every user of the host reads a command line in ps and /proc/PID/cmdline."""
    hidden, options = hide_passwords(argv)
    if hidden == argv:
        return
    title = " ".join(hidden)
    name = setproctitle.getthreadtitle()
    # setproctitle overwrites the memory of the original argv, which is what the kernel shows
    setproctitle.setproctitle(title)
    setproctitle.setthreadtitle(name)  # keep the short name (pgrep, top) it changed as well
    shown = "until start-up hid it" if setproctitle.getproctitle() == title else "all along"
    for option in options:
        click.echo(
            f"cdc-relay: warning: a password in {option} could be read in the process list "
            f"{shown}; give it through {SAFER_PLACES[option]} instead",
            err=True,
        )
