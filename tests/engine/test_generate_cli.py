"""`anyattn generate` in-process over a tiny model folder, and the loader's progress bar."""

from __future__ import annotations

import pytest
import torch

from anyattn.cli import main
from anyattn.engine.loader import _with_progress


@pytest.fixture
def folder(tiny_llm):
    llm, _ = tiny_llm("llama")
    return llm.model_path


def test_generate_streams_names_the_backend_and_explains_with_v(folder, capsys):
    assert main(["generate", "t5 t6 t7", "--model", str(folder), "--max-tokens", "4", "-v"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()  # the streamed text
    assert "attention backend: TORCH" in captured.err
    assert "selection for model.layers.0.self_attn.attn" in captured.err
    assert "  TORCH: chosen" in captured.err
    assert "tokens/s" in captured.err.splitlines()[-1]


def test_generate_reports_a_failed_request_among_several(folder, capsys):
    too_long = " ".join(["t5"] * 200)  # the tiny model's context is 128
    assert main(["generate", too_long, "t1 t2", "--model", str(folder), "--max-tokens", "3"]) == 1
    captured = capsys.readouterr()
    assert "anyattn generate: error:" in captured.err and "max_model_len" in captured.err
    assert "1 of 2 requests failed" in captured.err


def test_generate_bad_device_is_one_line(folder, capsys):
    assert main(["generate", "t1", "--model", str(folder), "--device", "tpu"]) == 1
    err = capsys.readouterr().err
    assert err == "anyattn generate: error: LLM: device must be 'cpu' or 'cuda' (got 'tpu').\n"


def test_progress_bar_is_quiet_when_not_a_terminal(capsys):
    items = [("a", torch.zeros(1)), ("b", torch.ones(1))]
    assert list(_with_progress(iter(items), "loading", 2)) == items
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
