"""`anyattn generate`: generate text with a model through the backend layer.

One prompt streams its text. Several run as one batch, each answer printed as one line,
`[i] text` (newlines shown as `\\n`), when its request finishes; on a terminal the answers
still running show below (`RunningView`). Every argument is checked before the weights load:
values at parsing (exit status 2, naming the flag), the backend name, and the prompts' lengths
against the model's context (read from its config and tokenizer).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console

from anyattn.cli_common import arg_type, backend_request, make_console, print_error
from anyattn.engine.arguments import encode_text, parse_device
from anyattn.engine.running_view import RunningView, visible_line
from anyattn.engine.sampling_params import SamplingParams
from anyattn.selector import ENV_VAR, FASTEST
from anyattn.types import parse_dtype

__all__ = ["DEFAULT_PROMPT", "UsageError", "add_generate_parser", "run_generate"]

DEFAULT_PROMPT = "Give me three tips for writing clear Python code."

_MAX_MODEL_LEN = 4096  # the longest prompt + answer (LLM's default), capped at the context


class UsageError(ValueError):
    """An argument that only the model shows to be wrong (exit status 2)."""


def _sampling_type(field: str, number: type[int] | type[float]) -> Callable[[str], object]:
    """An argparse type checked by SamplingParams' own rule for `field`."""

    def convert(text: str) -> object:
        try:
            value = number(text)
        except ValueError:
            kind = "an int" if number is int else "a number"
            raise argparse.ArgumentTypeError(f"must be {kind} (got {text!r})") from None
        try:
            SamplingParams(**{field: value})
        except ValueError as error:
            # (a flag given has a value: "None" is the flag left out)
            message = str(error).removeprefix(f"SamplingParams: {field} ").replace("None or ", "")
            raise argparse.ArgumentTypeError(message) from None
        return value

    convert.__name__ = field
    return convert


def _model_path(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(
            f"no such file or folder (got {text!r}, expected a .gguf file or a Hugging Face "
            "folder with config.json and *.safetensors)"
        )
    return path


def _prompt(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must not be empty (got {text!r})")
    return text


def add_generate_parser(commands: argparse._SubParsersAction) -> None:
    """Register the `generate` subcommand on the main parser's subcommands."""
    gen = commands.add_parser(
        "generate",
        help="generate text with a model (default: the embedded SmolLM2-135M-Instruct)",
        description=(
            "Stream a completion; prints the attention backend chosen and tokens/s. Several "
            "prompts run as one batch; each answer is one line, '[i] text', printed when it "
            "is done. Exit status 0: success; 1: the backend is unknown or does not fit, the "
            "model cannot be loaded, or a request failed; 2: bad arguments (checked before "
            "the model loads)."
        ),
    )
    gen.add_argument(
        "prompts",
        nargs="*",
        type=_prompt,
        metavar="PROMPT",
        help=f"text to complete (default: {DEFAULT_PROMPT!r})",
    )
    gen.add_argument(
        "--model",
        type=_model_path,
        metavar="PATH",
        help="a .gguf file or a Hugging Face folder (config.json + *.safetensors) "
        "(default: the embedded SmolLM2-135M-Instruct GGUF)",
    )
    gen.add_argument(
        "--backend",
        metavar="NAME",
        help="attention backend for every layer, an error if it does not fit; DECODE,PREFILL "
        "runs decodes on one backend and prefills on another over one KV cache; 'fastest' "
        "times the backends that fit on this machine and takes the fastest (cached), as such a "
        f"pair when the decode and prefill choices differ and can share a cache (default: "
        f"${ENV_VAR} if set, else the selector's choice)",
    )
    for flag, field, number, metavar, default, text in (
        ("--max-tokens", "max_tokens", int, "N", 128, "most tokens to generate per prompt"),
        ("--temperature", "temperature", float, "T", 0.0, "divides the logits before sampling "
         "(default: %(default)s: greedy)"),
        ("--top-k", "top_k", int, "K", 0, "sample from the K most likely tokens (default: "
         "%(default)s: all)"),
        ("--top-p", "top_p", float, "P", 1.0, "sample from the most likely tokens whose "
         "probability reaches P (default: %(default)s: off)"),
        ("--seed", "seed", int, "S", None, "seed of each request's own generator (default: "
         "none, torch's global one)"),
    ):  # fmt: skip
        if "(default: " not in text:
            text += " (default: %(default)s)"
        gen.add_argument(
            flag, type=_sampling_type(field, number), metavar=metavar, default=default, help=text
        )
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument(
        "--device",
        type=arg_type(lambda s: parse_device(s, argument="--device"), "--device"),
        default=None,
        help="cpu or cuda (default: cuda if torch sees a GPU, else cpu)",
    )
    gen.add_argument(
        "--dtype",
        type=arg_type(lambda s: parse_dtype(s, argument="--dtype"), "--dtype"),
        metavar="DTYPE",
        default=None,
        help="float32, float16 or bfloat16 (default: float32 on cpu, bfloat16 on cuda)",
    )
    gen.add_argument("-v", "--verbose", action="store_true", help="explain the backend choice")


def _check_prompts(
    prompts: Sequence[str], tokenizer, chat: bool, max_model_len: int, context: int
) -> None:
    limit = "" if max_model_len == context else f", the model's {context} capped"
    for index, prompt in enumerate(prompts, 1):
        n = len(encode_text(tokenizer, prompt, chat))
        if n == 0:
            raise UsageError(
                f"argument PROMPT: prompt {index} has no tokens (got {prompt!r}, expected at "
                "least one). Give it some text."
            )
        if n > max_model_len:
            raise UsageError(
                f"argument PROMPT: prompt {index} is longer than the model's context (got {n} "
                f"tokens, expected at most {max_model_len}{limit}). Shorten it."
            )


def _explain_layers(llm, console: Console) -> None:
    """The selector's verdict for each distinct layer configuration of the model, with the
    backends its layers run on marked (`chosen`, or `decode` and `prefill` for a pair)."""
    from anyattn.selector import explain
    from anyattn.types import DeviceInfo

    device = DeviceInfo.current(llm.device)
    configs: dict[object, object] = {}
    for layer in llm.model.attention_layers():
        configs.setdefault(layer.config, layer)  # the first layer of each config
    for config, layer in configs.items():
        decode = layer.backend.get_name()
        result = explain(config, device, decode)
        prefill = getattr(layer, "prefill_backend", None)
        marks = {decode: "chosen"}
        if prefill is not None:
            marks = {decode: "chosen: decode", prefill.get_name(): "chosen: prefill"}
        console.print(f"selection for {layer.layer_name} (and layers like it):")
        for verdict in result.verdicts:
            why = list(verdict.reasons) + ([verdict.unavailable] if verdict.unavailable else [])
            mark = marks.get(verdict.name) or "; ".join(why) or "fits"
            console.print(f"  {verdict.name}: {mark}")


def _backends_by_layer(layers: Sequence[object]) -> str:
    """Runs of consecutive layers on one backend, `0-2 TORCH_MLA (MLA), 3 TORCH` (a pair as
    `TORCH (decode) + FLEX_ATTENTION (prefill)`)."""

    def name(layer: object) -> str:
        name = layer.backend.get_name() + (" (MLA)" if layer.config.use_mla else "")
        prefill = getattr(layer, "prefill_backend", None)
        return name if prefill is None else f"{name} (decode) + {prefill.get_name()} (prefill)"

    runs = []
    for backend, run in itertools.groupby(enumerate(map(name, layers)), key=lambda x: x[1]):
        indices = [index for index, _ in run]
        span = f"{indices[0]}-{indices[-1]}" if len(indices) > 1 else str(indices[0])
        runs.append(f"{span} {backend}")
    return ", ".join(runs)


def _stream_one(llm, prompt: str, params: SamplingParams, chat: bool, err: Console) -> int:
    """Stream one prompt's text to stdout; returns its token count."""
    if chat:
        err.print(f"> {prompt}")
    start = time.perf_counter()
    first_at = None
    for delta in llm.stream(prompt, params, chat=chat):
        first_at = first_at or time.perf_counter()
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if first_at is not None:
        err.print(f"first text after {first_at - start:.2f} s")
    return len(llm.last_stream_output.outputs[0].token_ids)


def _run_several(
    llm, prompts: Sequence[str], params: SamplingParams, chat: bool, err: Console
) -> tuple[int, int]:
    """Run the prompts as one batch, printing each answer as one line when it finishes;
    returns (tokens generated, requests failed)."""
    for index, prompt in enumerate(prompts, 1):
        err.print(f"[{index}] > {visible_line(prompt)}")
    index_of: dict[int, int] = {}
    tokens = failed = 0
    view = RunningView(Console(highlight=False, markup=False, soft_wrap=True))
    try:
        with view:
            for index, prompt in enumerate(prompts, 1):
                index_of[llm.add_request(prompt, params, chat)] = index
            pending = set(index_of)
            while pending:
                for output in llm.step():
                    if output.request_id not in pending:
                        continue
                    index = index_of[output.request_id]
                    completion = output.outputs[0]
                    if not output.finished:
                        view.running(index, completion.text)
                        continue
                    pending.discard(output.request_id)
                    tokens += len(completion.token_ids)
                    if output.error:
                        failed += 1
                        view.finished(index)
                        message = f"[{index}] {output.error}"
                        view.error(lambda message=message: print_error("generate", message))
                    else:
                        view.finished(index, f"[{index}] {visible_line(completion.text)}")
                view.refresh()
    finally:
        for request_id in index_of:  # on an interrupt, stop what is still running
            llm.abort_request(request_id)
    return tokens, failed


def run_generate(args: argparse.Namespace) -> int:
    """Check the arguments the parser could not, load the model, generate; 0 on success, 1
    when a request failed.

    Raises:
        UsageError: a prompt of no tokens or longer than the context (before the weights load).
        ValueError: an unknown or unfitting backend, or a model the engine cannot run.
        FileNotFoundError: the default model is not installed.
    """
    from anyattn.engine.default_model import default_model_path
    from anyattn.engine.llm import LLM
    from anyattn.engine.loader import read_model

    err = make_console(stderr=True, soft_wrap=True)
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )
    requested, source = backend_request(args.backend, allow_pair=True)
    how = "chosen by the selector" if requested is None else f"requested by {source}"
    if requested is not None and requested.strip().lower() == FASTEST:
        how = f"measured per phase, requested by {source}"
    prompts = args.prompts or [DEFAULT_PROMPT]
    start = time.perf_counter()
    path = default_model_path() if args.model is None else args.model
    config, _, tokenizer = read_model(path)  # no weights read yet
    context = config.max_position_embeddings
    max_model_len = min(context, _MAX_MODEL_LEN)
    _check_prompts(prompts, tokenizer, args.chat, max_model_len, context)
    # without --backend the selector reads ANYATTN_BACKEND itself, so its errors name it
    try:
        llm = LLM(
            path,
            backend=args.backend,
            dtype=args.dtype,
            device=args.device,
            max_model_len=max_model_len,
        )
    except ValueError as error:
        # the selector names LLM's `backend` argument, here the flag; edited in place, the
        # error keeps its type and attributes
        if error.args and "(from argument)" in str(error.args[0]):
            error.args = (str(error.args[0]).replace("(from argument)", f"(from {source})"),)
        raise
    err.print(
        f"model {llm.model_path.name}: {len(llm.model.attention_layers())} attention layers on "
        f"{llm.device}, {str(llm.dtype).removeprefix('torch.')}; attention backend: "
        f"{', '.join(llm.backend_names)} ({how}; loaded in {time.perf_counter() - start:.1f} s)"
    )
    err.print(f"backend per layer: {_backends_by_layer(llm.model.attention_layers())}")
    for note in llm.backend_notes:
        err.print(f"backends: {note}")
    if args.verbose:
        _explain_layers(llm, err)
    start = time.perf_counter()
    if len(prompts) == 1:
        tokens = _stream_one(llm, prompts[0], params, args.chat, err)
    else:
        tokens, failed = _run_several(llm, prompts, params, args.chat, err)
        if failed:
            err.print(f"{tokens} tokens; {failed} of {len(prompts)} requests failed")
            return 1
    elapsed = time.perf_counter() - start
    err.print(f"{tokens} tokens in {elapsed:.2f} s: {tokens / max(elapsed, 1e-9):.1f} tokens/s")
    return 0
