"""`anyattn generate` in-process over a tiny model folder, and the loader's progress bar."""

from __future__ import annotations

import re
import shutil
import sys

import pytest
import torch

from anyattn.cli import main
from anyattn.engine import llm as llm_module
from anyattn.engine.loader import _with_progress
from anyattn.engine.models.weights import CountedWeights


@pytest.fixture
def folder(tiny_llm):
    llm, _ = tiny_llm("llama")
    return llm.model_path


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if the command gets as far as loading a model."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(llm_module, "LLM", refuse)


def one_error_line(err: str) -> str:
    assert err.count("\n") == 1 and err.endswith("\n") and "Traceback" not in err, err
    return err


def test_generate_streams_names_the_backend_and_explains_with_v(folder, capsys):
    assert main(["generate", "t5 t6 t7", "--model", str(folder), "--max-tokens", "4", "-v"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()  # the streamed text
    assert "attention backend: TORCH" in captured.err
    assert "selection for model.layers.0.self_attn.attn" in captured.err
    assert "  TORCH: chosen" in captured.err
    assert "tokens/s" in captured.err.splitlines()[-1]


def test_progress_bar_is_quiet_when_not_a_terminal(capsys):
    items = [("a", torch.zeros(1)), ("b", torch.ones(1))]
    assert list(_with_progress(CountedWeights(iter(items), 2), "loading")) == items
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_file_names_and_install_hints_in_square_brackets_are_printed_as_given(
    folder, tmp_path, capsys, make_backend, register
):
    named = shutil.copytree(folder, tmp_path / "tiny[bold] :smile:")
    hint = "flashinfer is not installed; pip install 'anyattn[flashinfer]'"
    register("FLASHINFER", make_backend("FLASHINFER", devices=("cuda",), unavailable=hint))
    argv = ["generate", "t5 [bold]t6", "t1", "--model", str(named), "--device", "cpu", "-v"]
    assert main([*argv, "--max-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "model tiny[bold] :smile:: 3 attention layers" in err
    assert f"  FLASHINFER: device cpu not supported (supported: cuda); {hint}\n" in err
    assert "[1] > t5 [bold]t6\n" in err


def test_backend_request_says_where_it_came_from(folder, capsys, monkeypatch):
    argv = ["generate", "t1", "--model", str(folder), "--device", "cpu", "--max-tokens", "1"]
    assert main(argv) == 0
    assert "attention backend: TORCH (chosen by the selector;" in capsys.readouterr().err
    assert main([*argv, "--backend", "torch"]) == 0
    assert "attention backend: TORCH (requested by --backend;" in capsys.readouterr().err
    monkeypatch.setenv("ANYATTN_BACKEND", "torch")
    assert main(argv) == 0
    assert "attention backend: TORCH (requested by ANYATTN_BACKEND;" in capsys.readouterr().err


@pytest.mark.parametrize("source", ["--backend", "ANYATTN_BACKEND"])
def test_a_backend_that_does_not_fit_names_its_source(folder, source, capsys, monkeypatch):
    argv = ["generate", "t1", "--model", str(folder), "--device", "cpu", "--max-tokens", "1"]
    if source == "--backend":
        argv += ["--backend", "TRITON"]
    else:
        monkeypatch.setenv("ANYATTN_BACKEND", "TRITON")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"requested backend TRITON (from {source}) cannot serve this config on cpu" in err


@pytest.mark.parametrize("source", ["--backend", "ANYATTN_BACKEND"])
def test_unknown_backend_names_its_source_before_loading(
    source, capsys, monkeypatch, no_model_load
):
    argv = ["generate", "t1"]
    if source == "--backend":
        argv += ["--backend", "nope"]
    else:
        monkeypatch.setenv("ANYATTN_BACKEND", "nope")
    assert main(argv) == 1
    err = one_error_line(capsys.readouterr().err)
    assert err.startswith(
        f"anyattn generate: error: {source}: unknown backend name (got 'nope', expected one of "
        "TORCH"
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--top-p", "1.5"], "argument --top-p: must be a number in (0, 1] (got 1.5)"),
        (["--top-p", "x"], "argument --top-p: must be a number (got 'x')"),
        (["--temperature", "-1"], "argument --temperature: must be a finite number >= 0 (got"),
        (["--temperature", "nan"], "argument --temperature: must be a finite number >= 0 (got"),
        (["--top-k", "-2"], "argument --top-k: must be an int >= 1, or 0 / -1 for off (got -2)"),
        (["--top-k", "1.5"], "argument --top-k: must be an int (got '1.5')"),
        (["--seed", "2" * 30], "argument --seed: must be an int in [-2**63, 2**64 - 1]"),
        (["--max-tokens", "0"], "argument --max-tokens: must be an int >= 1 (got 0)"),
        (["--dtype", "float8"], "argument --dtype: unknown dtype (got 'float8', expected one of"),
        (["--device", "tpu"], "argument --device: must be cpu or cuda (got 'tpu')"),
        (["--model", "/nonexistent/m.gguf"], "argument --model: no such file or folder (got"),
        ([""], "argument PROMPT: must not be empty (got '')"),
        (["t1", " "], "argument PROMPT: must not be empty (got ' ')"),
    ],
)
def test_bad_values_exit_2_naming_the_flag(args, expected, capsys, no_model_load):
    assert main(["generate", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = one_error_line(captured.err)
    assert err.startswith(f"anyattn generate: error: {expected}"), err
    assert err.endswith("; see 'anyattn generate --help'.\n")


def test_over_long_prompt_is_refused_before_the_model_loads(folder, capsys, no_model_load):
    too_long = " ".join(["t5"] * 129)  # the tiny model's context is 128
    assert main(["generate", "t1 t2", too_long, "--model", str(folder)]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert err == (
        "anyattn generate: error: argument PROMPT: prompt 2 is longer than the model's context "
        "(got 129 tokens, expected at most 128). Shorten it.\n"
    )


def test_help_shows_every_default(capsys):
    assert main(["generate", "--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    options = [i for i, line in enumerate(lines) if line.lstrip().startswith("--")]
    for start, end in zip(options, [*options[1:], len(lines)], strict=True):
        text = " ".join(" ".join(lines[start:end]).split())
        if not text.startswith(("--help", "--chat", "--verbose")):
            assert "(default: " in text, text
    text = " ".join(" ".join(lines).split())
    for default in ("(default: 128)", "(default: 0.0:", "(default: 1.0:", "ANYATTN_BACKEND"):
        assert default in text


def _two_prompts(folder, capsys, monkeypatch) -> str:
    """Run two prompts: the first reaches the context (128 tokens) after 2 tokens, the second
    runs on. Returns what stdout had received before the last engine step."""
    long = " ".join(["t5"] * 126)
    written_before_step = []
    step = llm_module.LLM.step

    def spy(self):
        written_before_step.append(capsys.readouterr().out)
        return step(self)

    monkeypatch.setattr(llm_module.LLM, "step", spy)
    argv = ["generate", long, "t1 t2", "--model", str(folder), "--max-tokens", "10"]
    assert main([*argv, "--device", "cpu"]) == 0
    return "".join(written_before_step)


def test_several_prompts_stream_one_line_each_as_they_finish(folder, capsys, monkeypatch):
    streamed = _two_prompts(folder, capsys, monkeypatch)
    rest = capsys.readouterr()
    assert [line[:4] for line in streamed.splitlines()] == ["[1] "]
    assert [line[:4] for line in rest.out.splitlines()] == ["[2] "]
    assert "tokens/s" in rest.err.splitlines()[-1]


def test_a_backend_pair_runs_decodes_and_prefills_apart(folder, capsys):
    argv = ["generate", "t5 t6 t7", "--model", str(folder), "--device", "cpu", "--max-tokens", "3"]
    assert main([*argv, "--backend", "TORCH,FLEX_ATTENTION", "-v"]) == 0
    err = capsys.readouterr().err
    assert "attention backend: FLEX_ATTENTION, TORCH (requested by --backend;" in err
    assert "backend per layer: 0-2 TORCH (decode) + FLEX_ATTENTION (prefill)\n" in err
    assert "backends: decodes on TORCH, prefills on FLEX_ATTENTION (requested)\n" in err
    assert "  TORCH: chosen: decode\n" in err and "  FLEX_ATTENTION: chosen: prefill\n" in err


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("TORCH,NOPE", "--backend: unknown backend name (got 'NOPE', expected one of TORCH"),
        ("TORCH,TORCH,TORCH", "--backend: a backend pair is two names (got 'TORCH,TORCH,TORCH'"),
    ],
)
def test_a_bad_backend_pair_is_refused_before_loading(value, expected, capsys, no_model_load):
    assert main(["generate", "t1", "--backend", value]) == 1
    err = one_error_line(capsys.readouterr().err)
    assert err.startswith(f"anyattn generate: error: {expected}")


def test_on_a_terminal_running_answers_show_as_they_are_generated(folder, capsys, monkeypatch):
    # The same batch, stdout a terminal: while the second request runs on, its line shows its
    # text so far; the finished lines are those printed without a terminal.
    plain_run = _two_prompts(folder, capsys, monkeypatch) + capsys.readouterr().out
    finished = plain_run.splitlines()
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setenv("TERM", "xterm")
    streamed = _two_prompts(folder, capsys, monkeypatch)
    ansi = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")
    before_end = ansi.sub("\n", streamed).splitlines()
    running = [line for line in before_end if line.startswith("[2] ") and line not in finished]
    assert running  # the second answer, shown before it ended
    lines = ansi.sub("\n", streamed + capsys.readouterr().out).splitlines()
    assert [line for line in lines if line in finished] == finished
