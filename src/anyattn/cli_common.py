"""What the `anyattn` subcommands share: one-line usage errors, argument types that report the
library's own messages, the backend a command is asked for, and consoles that print text as
given: most of what they print comes from elsewhere (plugin names and install hints, prompts,
generated text), where rich would read `[bold]` or `'anyattn[flashinfer]'` as markup and
`:smile:` as an emoji code, so markup, emoji and highlighting are off and the command's own
styles are `rich.text.Text` spans.
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
    """Wrap a library parser (text -> value, raising ValueError) so that argparse reports its
    message, less a leading `"{label}: "` (argparse adds "argument --flag: ")."""

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
    """The backend a command is asked for, `(name, source)`: the `--backend` value
    (`flag_value`), else `$ANYATTN_BACKEND`, else None; source is "--backend" or
    "ANYATTN_BACKEND". The name may be "fastest", or with `allow_pair` (`anyattn generate`)
    a pair "DECODE,PREFILL".

    Raises:
        ValueError: a name that is not a registered backend, or more than allowed; the message
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
