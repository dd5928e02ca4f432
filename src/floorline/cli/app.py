"""The typer apps, and how a command ends: main() turns every error into one line and an exit
code, fail() ends a command whose every measurement failed, interruptible() handles Ctrl-C."""

from __future__ import annotations

import functools
import os
import sys
from typing import NoReturn

import typer

from floorline.cli.render import err
from floorline.errors import FloorlineError, one_line
from floorline.localcache import settle_home

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                  help="Batch-1 LLM decode against its memory floor.")
models_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                         no_args_is_help=False, invoke_without_command=True)
app.add_typer(models_app, name="models")


def fail(line: str) -> NoReturn:
    """End a command whose every measurement failed: one line, exit 1 (bad input exits 2)."""
    err.print(f"floorline: error: {line}", highlight=False, markup=False, soft_wrap=True)
    raise typer.Exit(1)


def interruptible(leaves: str):
    """A command that Ctrl-C ends with one line saying what it leaves, and exit 130: typer
    would turn the interrupt into a silent exit 130 before main() could see it."""
    def wrap(command):
        @functools.wraps(command)
        def run(*args, **kwargs):
            try:
                return command(*args, **kwargs)
            except KeyboardInterrupt:
                err.print(f"floorline: interrupted; {leaves}", highlight=False, markup=False)
                raise typer.Exit(130) from None
        return run
    return wrap


def main() -> None:
    # click's exceptions as this typer raises them (newer typers carry their own copy of click)
    click_errors = {c.__name__: c for c in typer.BadParameter.__mro__}
    try:
        settle_home()
        sys.exit(app(standalone_mode=False))
    except click_errors["UsageError"] as e:  # an unknown option, a missing or malformed value
        command = f"floorline {e.ctx.info_name}" if e.ctx and e.ctx.parent else "floorline"
        err.print(f"floorline: error: {one_line(e.format_message())} (see `{command} --help`)",
                  highlight=False, markup=False, soft_wrap=True)
        sys.exit(2)
    except click_errors["ClickException"] as e:
        err.print(f"floorline: error: {one_line(e.format_message())}", highlight=False,
                  markup=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except FloorlineError as e:
        err.print(f"floorline: error: {one_line(e)}", highlight=False, markup=False, soft_wrap=True)
        sys.exit(2)
    except Exception as e:
        if os.environ.get("FLOORLINE_DEBUG"):
            raise
        err.print(f"floorline: internal error: {type(e).__name__}: {one_line(e)} "
                  "(FLOORLINE_DEBUG=1 shows the traceback)", highlight=False, markup=False,
                  soft_wrap=True)
        sys.exit(1)
