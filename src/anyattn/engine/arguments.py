"""Checks and parsing of `LLM`'s arguments: memory sizes, devices, prompts and sampling
parameters. Errors name the argument, what was given and what is accepted."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence

import torch

from anyattn.engine.sampling_params import SamplingParams

__all__ = [
    "check_generate_args",
    "check_params",
    "check_token_ids",
    "encode_text",
    "parse_device",
    "parse_memory",
]


def parse_memory(value: int | str) -> int:
    """Bytes from an int or a string such as "512MiB" or "1.5G"; ValueError otherwise."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        text = value.strip().lower().removesuffix("b").removesuffix("i")
        units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
        scale = units.get(text[-1:], 1)
        number = text[:-1] if text[-1:] in units else text
        try:
            parsed = float(number) * scale
        except ValueError:
            parsed = 0
        if math.isfinite(parsed) and parsed >= 1:
            return int(parsed)
    raise ValueError(
        f"LLM: kv_cache_memory must be a positive byte count such as 268435456 or '256MiB' "
        f"(got {value!r})."
    )


def parse_device(device: str | torch.device | None, argument: str = "LLM: device") -> torch.device:
    """A CPU or an available CUDA device (default: CUDA when available); ValueError otherwise,
    the message starting with `argument`."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"{argument}: must be cpu or cuda (got {device!r}).")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"{argument}: {str(device)!r} names this machine's GPU, but torch sees none (got "
            f"torch {torch.__version__}, expected cpu)."
        )
    return parsed


def check_params(params: SamplingParams | None) -> SamplingParams:
    """The given `SamplingParams`, or the defaults for None; TypeError for anything else."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError(f"LLM: params must be a SamplingParams (got {type(params).__name__}).")
    return params


def _is_token_ids(prompts: object) -> bool:
    """A single prompt given as ids: a 1-D array/tensor, or a non-empty list of integers."""
    if getattr(prompts, "ndim", None) == 1:
        return True
    return (
        isinstance(prompts, Sequence)
        and not isinstance(prompts, str)
        and len(prompts) > 0
        and isinstance(prompts[0], numbers.Integral)
    )


def check_token_ids(prompt: object, chat: bool, vocab_size: int) -> list[int]:
    """A prompt given as token ids (a list, a 1-D array or tensor of ints) as a list. TypeError:
    another type, or ids that are not integers; ValueError: ids outside the vocabulary, or
    `chat` with ids."""
    if hasattr(prompt, "tolist") and getattr(prompt, "ndim", 1) == 1:
        prompt = prompt.tolist()  # numpy arrays and tensors of ids
    if isinstance(prompt, bytes | bytearray) or not isinstance(prompt, Sequence):
        raise TypeError(
            f"LLM: a prompt must be a str or a list of token ids (got {type(prompt).__name__})."
        )
    if chat:
        raise ValueError(
            "LLM: chat=True needs text prompts (got token ids); apply the chat template "
            "yourself or pass the text."
        )
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
        raise TypeError("LLM: prompt token ids must be integers (got other values).")
    ids = [int(t) for t in prompt]
    if not all(0 <= t < vocab_size for t in ids):
        raise ValueError(
            f"LLM: prompt token ids must lie in [0, {vocab_size}) (got values outside it)."
        )
    return ids


def check_generate_args(prompts: object, params: object) -> tuple[list, list[SamplingParams]]:
    """`LLM.generate`'s prompts as a list, and one `SamplingParams` per prompt (TypeError /
    ValueError naming the argument)."""
    if isinstance(prompts, str) or _is_token_ids(prompts):
        prompts = [prompts]
    if isinstance(prompts, Mapping | bytes | bytearray) or not hasattr(prompts, "__iter__"):
        raise TypeError(
            f"LLM.generate: prompts must be a str, token ids, or a list of those (got "
            f"{type(prompts).__name__})."
        )
    prompts = list(prompts)
    if params is None or isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    elif isinstance(params, str) or not isinstance(params, Sequence):
        raise TypeError(
            f"LLM.generate: params must be a SamplingParams or a list of them (got "
            f"{type(params).__name__})."
        )
    params = [check_params(p) for p in params]
    if len(params) != len(prompts):
        raise ValueError(
            f"LLM.generate: params must be one SamplingParams or one per prompt (got "
            f"{len(params)} for {len(prompts)} prompts)."
        )
    return prompts, params


def encode_text(tokenizer, prompt: str, chat: bool) -> list[int]:
    """Token ids of a text prompt, wrapped in the tokenizer's chat template when `chat`."""
    if not chat:
        return list(tokenizer.encode(prompt))
    messages = [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
