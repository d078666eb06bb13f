"""Checkpoint tensors into model parameters, by Hugging Face name: a `WeightSlot` says where
one lands (a view of a parameter, rows of a fused one, copies in other layouts, and an
optional transform)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["CountedWeights", "WeightSlot", "empty_param", "load_into_slots"]

_MAX_NAMES = 8


class CountedWeights(Iterator[tuple[str, torch.Tensor]]):
    """A lazy one-pass stream of checkpoint `(name, tensor)` pairs; `len()` counts them all."""

    def __init__(self, items: Iterator[tuple[str, torch.Tensor]], count: int) -> None:
        self._items, self._count = items, count

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._items)

    def __len__(self) -> int:
        return self._count


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """An uninitialised, frozen parameter (the checkpoint fills it)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


@dataclass(frozen=True, slots=True)
class WeightSlot:
    """Where one checkpoint tensor goes: `target`, a view of a parameter of the tensor's
    shape, a `transform` applied before the copy (e.g. Gemma's `1 + w`), and `copies` that take
    the same values (a CPU `Linear`'s second layout)."""

    target: torch.Tensor
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    copies: tuple[torch.Tensor, ...] = ()


def load_into_slots(
    api: str,
    slots: Mapping[str, WeightSlot],
    weights: Iterable[tuple[str, torch.Tensor]],
    ignore: Callable[[str], bool] = lambda name: False,
) -> None:
    """Copy each streamed `(name, tensor)` into `slots[name].target` and its copies, cast to
    their dtype; names for which `ignore` holds may lack a slot. ValueError (prefixed `api`)
    names every missing, unexpected and mis-shaped tensor at once."""
    loaded: set[str] = set()
    unexpected: list[str] = []
    misshaped: list[str] = []
    with torch.no_grad():
        for name, tensor in weights:
            slot = slots.get(name)
            if slot is None:
                if not ignore(name):
                    unexpected.append(name)
                continue
            if tuple(tensor.shape) != tuple(slot.target.shape):
                misshaped.append(
                    f"{name} (got {tuple(tensor.shape)}, expected {tuple(slot.target.shape)})"
                )
                continue
            value = slot.transform(tensor) if slot.transform else tensor
            for target in (slot.target, *slot.copies):
                target.copy_(value)
            loaded.add(name)
    missing = [name for name in slots if name not in loaded]
    problems = [
        f"{label}: {_names(names)}"
        for label, names in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("mis-shaped", misshaped),
        )
        if names
    ]
    if problems:
        raise ValueError(
            f"{api}: the checkpoint does not match the model ({'; '.join(problems)}). Check that "
            "the config and the weights come from the same model."
        )


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES])
    more = len(names) - _MAX_NAMES
    return f"{shown} and {more} more" if more > 0 else shown
