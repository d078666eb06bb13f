"""The answers still running in `anyattn generate`, shown on a terminal as they are generated:
one line per running request, `[i] <the end of its text>` cropped to the terminal's width,
below the lines already printed, erased when it stops (rich's transient `Live`). Where stdout
is not a terminal it shows nothing, so pipes and files receive only the finished lines.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from rich.cells import cell_len
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

__all__ = ["RunningView", "tail_cells", "visible_line"]


def visible_line(text: str) -> str:
    """`text` on one line: carriage returns and newlines shown as `\\r` and `\\n`."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


def tail_cells(text: str, cells: int) -> str:
    """The end of `text` that fits in `cells` terminal cells (wide characters take two)."""
    text = text[-cells:]  # no character takes less than one cell
    while cell_len(text) > cells:
        text = text[max(1, (cell_len(text) - cells) // 2) :]
    return text


class RunningView:
    """One line per running request under the finished output, on a terminal only."""

    def __init__(self, out: Console) -> None:
        self.out = out
        self._running: dict[int, str] = {}  # prompt position -> its text so far
        self._live: Live | None = None
        if out.is_terminal and sys.stdout.isatty():
            self._live = Live(
                self._render(), console=out, auto_refresh=False, transient=True,
                redirect_stdout=False, redirect_stderr=False,
            )  # fmt: skip

    def __enter__(self) -> RunningView:
        if self._live is not None:
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()

    def _render(self) -> Group:
        lines = []
        for index, text in sorted(self._running.items()):
            prefix = f"[{index}] "
            room = max(self.out.width - 1 - cell_len(prefix), 8)
            lines.append(Text(prefix + tail_cells(visible_line(text), room), no_wrap=True))
        return Group(*lines)

    def running(self, index: int, text: str) -> None:
        """Request `index` has generated `text` so far."""
        if self._live is not None:
            self._running[index] = text

    def finished(self, index: int, line: str | None = None) -> None:
        """Request `index` is done; `line` (if any) is printed above the view."""
        self._running.pop(index, None)
        if line is not None:
            self.out.print(Text(line))
            self.out.file.flush()

    def error(self, report: Callable[[], None]) -> None:
        """Run `report` (which writes to stderr) with the view taken off the terminal."""
        if self._live is None:
            report()
            return
        self._live.stop()
        report()
        self._live.start()

    def refresh(self) -> None:
        """Redraw the running lines (once per engine step)."""
        if self._live is not None:
            self._live.update(self._render(), refresh=True)
