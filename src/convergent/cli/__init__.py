"""The ``convergent`` command line: one sub-command per stage, thin over the stage APIs.

Each stage module in this package has ``register(app)`` adding its commands; heavy
imports (torch, dask, tblite) happen inside the commands so ``--help`` stays fast.
Every failure prints one line ``error: ... (hint: ...)`` and exits 2 (a user's
mistake: usage, config, input) or 1 (a bug); ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import os
import sys

import typer

from convergent import __version__
from convergent.cli import data, demo, learn, md, report, runs, screen, serve, simulate, train

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
    """Stages: demo, simulate, data, train, screen, md, learn, report, serve (+ generate, bench-serve, runs)."""
    if debug:
        os.environ["CONVERGENT_DEBUG"] = "1"


for _module in (demo, simulate, data, train, screen, md, learn, report, serve, runs):
    _module.register(app)


def _debug_requested(argv: list[str]) -> bool:
    return "--debug" in argv or os.environ.get("CONVERGENT_DEBUG", "") not in ("", "0")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``convergent`` console script; returns the exit code.

    Every failure ends as one line ``error: ...`` on stderr (see :mod:`convergent.cli.errors`):
    exit 2 for a user's mistake, 1 for a bug; ``--debug`` re-raises with the traceback.
    """
    from convergent.cli import errors

    args = list(sys.argv[1:] if argv is None else argv)
    debug = _debug_requested(args)
    saved = os.environ.get("CONVERGENT_DEBUG")  # the --debug callback sets it for this run
    command = typer.main.get_command(app)
    try:
        result = command.main(args=args, prog_name="convergent", standalone_mode=False)
    except errors.EXITS as exc:
        return int(getattr(exc, "exit_code", 0) or 0)
    except errors.ABORTS:
        typer.echo("aborted", err=True)
        return 130
    except KeyboardInterrupt:
        typer.echo("aborted", err=True)
        return 130
    except Exception as exc:
        if debug:
            raise
        return errors.report(exc, args, command)
    finally:
        if saved is None:
            os.environ.pop("CONVERGENT_DEBUG", None)
        else:
            os.environ["CONVERGENT_DEBUG"] = saved
    return result if isinstance(result, int) else 0


def entry() -> None:
    """Console-script wrapper: exit with :func:`main`'s code."""
    sys.exit(main())
