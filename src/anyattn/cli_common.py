"""What the `anyattn` subcommands share: usage errors of one line, argument types that report
the library's own messages, the backend a command is asked for, and consoles that print text as
it is given.

Most of what the command line prints is not its own: backend names and install hints from
plugins, file names, prompts, generated text, error messages. rich would read `[bold]` or
`'anyattn[flashinfer]'` in them as markup and `:smile:` as an emoji code, so every console made
here has markup, emoji codes and highlighting off; the command's own styles are applied with
`rich.text.Text` spans instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from rich.console import Console

from anyattn.registry import backend_names
from anyattn.selector import ENV_VAR, FASTEST

__all__ = [
    "BACKEND_FLAG",
    "ArgumentParser",
    "arg_type",
    "backend_request",
    "make_console",
    "positive_int",
    "print_error",
]

BACKEND_FLAG = "--backend"


class ArgumentParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message.rstrip('.')}; see '{self.prog} --help'.\n")


def arg_type(parse: Callable[[str], object], label: str) -> Callable[[str], object]:
    """Wrap a library parser so that argparse reports the parser's message, not a generic one.

    Args:
        parse: turns the argument's text into its value; raises ValueError with a message that
            may start with `"{label}: "`.
        label: the name the message starts with (dropped: argparse adds "argument --flag: ").
    """

    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error).removeprefix(f"{label}: ")) from None

    convert.__name__ = label
    return convert


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int (got {text!r}, expected >= 1)")
    return value


def backend_request(flag_value: str | None, allow_pair: bool = False) -> tuple[str | None, str]:
    """The backend a command is asked for and where the request came from.

    Args:
        flag_value: the `--backend` argument, or None when it was not given.
        allow_pair: accept "DECODE,PREFILL" (`anyattn generate` runs the phases on two
            backends; `explain` judges one).

    Returns:
        `(name, source)`: the name from `--backend`, else from `$ANYATTN_BACKEND`, else None
        (a name, "fastest", or a pair "DECODE,PREFILL" of names); source is `"--backend"` or
        `"ANYATTN_BACKEND"` (`"--backend"` when nothing is asked).

    Raises:
        ValueError: a name that is not a registered backend, or more than two; the message
            names its source.
    """
    name, source = flag_value, BACKEND_FLAG
    if name is None and os.environ.get(ENV_VAR, "").strip():
        name, source = os.environ[ENV_VAR].strip(), ENV_VAR
    if name is not None and name.strip().lower() == FASTEST:
        return name, source  # measured selection, not a backend name
    parts = [] if name is None else name.split(",")
    if len(parts) > 2 or (len(parts) == 2 and not allow_pair):
        expected = "two names, decode then prefill, e.g. TRITON,FLASHINFER"
        raise ValueError(
            f"{source}: one backend name expected (got {name!r}, a pair)."
            if not allow_pair
            else f"{source}: a backend pair is two names (got {name!r}, expected {expected})."
        )
    for part in parts:
        if part.strip().upper() not in backend_names():
            raise ValueError(
                f"{source}: unknown backend name (got {part.strip()!r}, expected one of "
                f"{', '.join(backend_names())})."
            )
    return name, source


def make_console(*, stderr: bool = False, soft_wrap: bool = False) -> Console:
    """A rich console that prints strings exactly as given (no markup, emoji codes or
    highlighting, which also coloured numbers and quotes in reasons at random)."""
    return Console(stderr=stderr, markup=False, emoji=False, highlight=False, soft_wrap=soft_wrap)


def print_error(command: str, message: str) -> None:
    """`anyattn <command>: error: <message>` on stderr, as one line, written as given."""
    sys.stderr.write(f"anyattn {command}: error: {message}\n")
