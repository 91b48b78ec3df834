"""The ``convergent`` command line: one sub-command per stage, thin over the stage APIs.

Each stage module in this package has ``register(app)`` adding its commands; heavy
imports (torch, dask, tblite) happen inside the commands so ``--help`` stays fast.
A :class:`~convergent.errors.ConvergentError` prints ``error: ...`` (and ``hint: ...``)
and exits 2 without a traceback unless ``--debug`` is given.
"""

from __future__ import annotations

import os
import sys

import click
import typer

from convergent import __version__
from convergent.cli import data, demo, report, screen, serve, simulate, train
from convergent.errors import ConvergentError

app = typer.Typer(
    name="convergent",
    help="Simulation, big data and AI as one converged HPC workflow.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"convergent {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors."),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """Stages: demo, simulate, data, train, screen, report, serve (+ generate, bench-serve)."""
    if debug:
        os.environ["CONVERGENT_DEBUG"] = "1"


for _module in (demo, simulate, data, train, screen, report, serve):
    _module.register(app)


def _print_error(exc: ConvergentError) -> None:
    click.echo(f"error: {exc.message}", err=True)
    if exc.hint:
        click.echo(f"hint: {exc.hint}", err=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``convergent`` console script; returns the exit code."""
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        result = app(args=argv, standalone_mode=False)
    except ConvergentError as exc:
        if debug:
            raise
        _print_error(exc)
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    return result if isinstance(result, int) else 0


def entry() -> None:
    """Console-script wrapper: exit with :func:`main`'s code."""
    sys.exit(main())
