"""The ``trainfit`` console script: one registry of commands (accelerate's pattern) and one error policy.

Every command module exposes ``register(app)``. User errors (``TrainfitError`` and typer's own usage
errors) print one line to stderr and exit with status 2; nothing else is caught, so bugs keep their
tracebacks.
"""

from __future__ import annotations

import sys
from importlib import import_module

import typer

from trainfit.errors import TrainfitError

#: Command modules, in help order. Each must define ``register(app: typer.Typer) -> None``.
COMMAND_MODULES: tuple[str, ...] = (
    "trainfit.cli.estimate",
    "trainfit.cli.catalog",
    "trainfit.cli.formats",
    "trainfit.cli.precision",
    "trainfit.cli.doctor",
)

app = typer.Typer(
    name="trainfit",
    help="How much GPU memory a training run needs, where it goes, and whether it fits.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

for _mod in COMMAND_MODULES:
    import_module(_mod).register(app)


def fail(message: str) -> None:
    """Print a one-line error and exit 2."""
    typer.echo(f"error: {message}", err=True)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the typer app, turning user errors into one line and exit status 2."""
    try:
        app(args=argv, standalone_mode=True)
    except TrainfitError as exc:
        fail(str(exc))
    except SystemExit as exc:
        if exc.code not in (None, 0) and exc.code != 2 and not isinstance(exc.code, int):
            fail(str(exc.code))
        raise


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
