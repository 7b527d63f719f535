"""The ``trainfit`` console script: one registry of commands (accelerate's pattern) and one error policy.

Every command module exposes ``register(app)``. User errors print one line, ``error: ...``, to stderr and
exit with status 2: ``TrainfitError`` from the library and click's usage errors (a bad option value, an
unknown option or command, an extra argument), which typer would otherwise draw as a multi-line box. The
app therefore runs in click's non-standalone mode and this module does the printing. Nothing else is
caught, so bugs keep their tracebacks. ``trainfit`` alone prints the help (exit status 2, as click does).
"""

from __future__ import annotations

import inspect
import sys
from importlib import import_module
from typing import Annotated, NoReturn

import typer

from trainfit.errors import TrainfitError

try:  # typer >= 0.25 vendors click as typer._click; older releases raise click's own exceptions
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - depends on the installed typer
    from click import exceptions as click_errors  # type: ignore[no-redef]

#: Command modules, in help order. Each must define ``register(app: typer.Typer) -> None``.
COMMAND_MODULES: tuple[str, ...] = (
    "trainfit.cli.estimate",
    "trainfit.cli.plan",
    "trainfit.cli.infer",
    "trainfit.cli.catalog",
    "trainfit.cli.formats",
    "trainfit.cli.precision",
    "trainfit.cli.doctor",
    "trainfit.cli.serve",
)

app = typer.Typer(
    name="trainfit",
    help="How much GPU memory a training run needs, where it goes, and whether it fits.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from trainfit import __version__

        typer.echo(f"trainfit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", help="Print the version and exit.", callback=_version, is_eager=True),
    ] = False,
) -> None:
    """How much GPU memory a training run needs, where it goes, and whether it fits."""


for _mod in COMMAND_MODULES:
    import_module(_mod).register(app)
for _info in app.registered_commands:  # the command list's one-liners: a docstring's first paragraph, unwrapped
    if _info.short_help is None and _info.callback is not None and _info.callback.__doc__:
        _info.short_help = " ".join(inspect.cleandoc(_info.callback.__doc__).split("\n\n")[0].split())


def fail(message: str) -> NoReturn:
    """Print a one-line error and exit 2."""
    typer.echo(f"error: {' '.join(message.split())}", err=True)
    raise SystemExit(2)


def _usage_message(exc: click_errors.UsageError) -> str:
    """click's message on one line, lower-cased like ours, with where to read the usage."""
    text = " ".join(exc.format_message().split()) or "invalid usage"
    if len(text) > 1 and text[0].isupper() and not text[1].isupper():
        text = text[0].lower() + text[1:]
    command = exc.ctx.command_path if exc.ctx is not None else "trainfit"
    return f"{text.rstrip('.')}; see '{command} --help'"


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the typer app, turning user errors into one line and exit status 2."""
    try:
        code = app(args=argv, prog_name="trainfit", standalone_mode=False)
    except TrainfitError as exc:
        fail(str(exc))
    except click_errors.NoArgsIsHelpError as exc:
        typer.echo(exc.ctx.get_help() if exc.ctx is not None else "")
        raise SystemExit(exc.exit_code) from None
    except click_errors.UsageError as exc:
        fail(_usage_message(exc))
    except click_errors.ClickException as exc:  # e.g. a click.File or click.Path parameter that cannot be opened
        fail(exc.format_message())
    except typer.Abort:
        fail("aborted")
    except SystemExit as exc:
        if exc.code not in (None, 0) and exc.code != 2 and not isinstance(exc.code, int):
            fail(str(exc.code))
        raise
    if isinstance(code, int) and code != 0:  # typer.Exit(code) from a command
        raise SystemExit(code)


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
