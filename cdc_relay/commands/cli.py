"""The ``cdc-relay`` command group: its commands (a module each) registered, ``--config`` given
to each, and ``main``, which shows the errors users can meet as one line, not a traceback."""

from __future__ import annotations

import gc
import sys

import click

from cdc_relay import __version__
from cdc_relay.commands import stops
from cdc_relay.commands.config_file import commands_below, config_option
from cdc_relay.commands.config_show import config_group
from cdc_relay.commands.dead_letters import dead_letters_group
from cdc_relay.commands.drop_slot import drop_slot
from cdc_relay.commands.poll import poll
from cdc_relay.commands.process_title import hide_passwords_from_the_process_list
from cdc_relay.commands.prune import prune_command
from cdc_relay.commands.reshard import reshard_command
from cdc_relay.commands.schema import schema_group
from cdc_relay.commands.setup_slot import setup_slot
from cdc_relay.commands.status import status_command
from cdc_relay.commands.stream import stream
from cdc_relay.commands.trace import trace_command
from cdc_relay.compiled import build
from cdc_relay.errors import RelayError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(
    __version__, prog_name="cdc-relay", message=f"%(prog)s, version %(version)s, {build()}"
)
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Relay transactional-outbox events from PostgreSQL to Kafka.

    Every option of every command is also an environment variable, CDC_RELAY_ and its long
    name (--kafka-bootstrap: CDC_RELAY_KAFKA_BOOTSTRAP), and a key of the --config file
    (kafka-bootstrap = "..."). A flag wins over the variable, the variable over the file.
    cdc-relay config show COMMAND prints what COMMAND gets, and from where.
    """
    if ctx.invoked_subcommand not in _RELAYS:
        stops.restore_stops()  # the other commands stop as any program does


_RELAYS = ("stream", "poll")
"""The commands that defer a stop asked for during start-up until they can act on it."""

for command in (
    setup_slot,
    schema_group,
    trace_command,
    drop_slot,
    reshard_command,
    status_command,
    stream,
    poll,
    dead_letters_group,
    prune_command,
    config_group,
):
    cli.add_command(command)

for _, _command in commands_below(cli):
    _command.params.insert(0, config_option())


def main() -> None:
    """Console entry point: user-facing errors become one line on stderr, not a traceback."""
    hide_passwords_from_the_process_list(sys.orig_argv)
    code = _run()
    # The Kafka clients a command made are freed now, while the interpreter runs: a client
    # left to the interpreter's finalization (a failed start's, in a cycle with the sink its
    # callbacks are bound to) ran librdkafka's last callbacks there, and the process died of
    # SIGSEGV after its one-line error (seen once in CI: exit -11 for a refused password).
    gc.collect()
    sys.exit(code)


def _run() -> int:
    try:
        code = cli.main(prog_name="cdc-relay", standalone_mode=False)
    except RelayError as exc:
        click.echo(f"cdc-relay: error: {exc}", err=True)
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 1
    return code if isinstance(code, int) else 0
