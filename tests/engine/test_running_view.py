"""`anyattn generate`'s view of the answers still running: only on a terminal, cropped by
terminal cells from the end, errors to the real stderr."""

from __future__ import annotations

import io
import sys

from rich.cells import cell_len
from rich.console import Console

from anyattn.engine.running_view import RunningView, tail_cells


def test_the_tail_fits_its_cells_with_wide_characters():
    text = "abc" + "世界你好" * 10  # CJK characters take two cells each
    for cells in (1, 5, 8, 9, 30):
        tail = tail_cells(text, cells)
        assert text.endswith(tail) and cell_len(tail) <= cells
        longer = text[-len(tail) - 1 :]
        assert cell_len(longer) > cells  # one more character would not fit
    assert tail_cells("short", 30) == "short"


def test_nothing_is_shown_where_stdout_is_not_a_terminal(monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    screen = io.StringIO()
    with RunningView(Console(file=screen, force_terminal=True)) as view:
        view.running(1, "partial")
        view.refresh()
        view.finished(1, "[1] done")
    assert screen.getvalue() == "[1] done\n"


def test_errors_go_to_the_real_stderr_with_the_view_paused(monkeypatch, capsys):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    screen = io.StringIO()
    with RunningView(Console(file=screen, force_terminal=True, width=40)) as view:
        view.running(2, "x" * 100)
        view.refresh()
        assert "[2] " + "x" * 35 in screen.getvalue()  # the end of the text, in 39 cells
        view.error(lambda: print("anyattn generate: error: [1] boom", file=sys.stderr))
    assert capsys.readouterr().err == "anyattn generate: error: [1] boom\n"
    assert "boom" not in screen.getvalue()
