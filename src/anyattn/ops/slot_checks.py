"""Value checks of a KV write's `slot_mapping` and scales, made once per unchanged tensor.

`check_slot_and_scale_values` checks what only the tensors' values can show: every slot of the
first `num_tokens` entries of `slot_mapping` is -1 (padding) or in `[0, num_blocks * block_size)`
and no two tokens share a non-negative slot; fp8 scales are finite and > 0; scales given for a
non-fp8 cache are all 1 (they would otherwise be silently dropped). Shapes, dtypes and devices
are the caller's to check first.

Checking values needs them on the host: on CUDA a device-to-host sync, which stalls a host that
should run ahead of the GPU. Every layer of a step passes the same `slot_mapping`, and each layer
the same scales step after step, so a successful check is recorded on the checked tensor itself,
in the private attribute `_anyattn_checked` (a `_Checked`: which check, and the tensor's
`_version`, data_ptr, shape and stride at the time); a later call on the unchanged tensor skips
that check. An eager step thus syncs once (its first layer) instead of once per layer, and scales
are read once. The record lives on the tensor, not in a module-level cache (no global state; it
goes with the tensor). torch bumps `_version` on every in-place write it performs (`copy_` into a
persistent buffer, index writes, writes through a view), so a changed tensor is checked again;
writes torch does not see (through `.numpy()`, `.data`, DLPack, or a kernel writing through
`data_ptr()`) must be followed by `torch.autograd.graph.increment_version(tensor)`. Inference
tensors (created under `torch.inference_mode()`) have no version counter: they are checked on
every call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["check_slot_and_scale_values"]

# The tensor attribute holding a `_Checked` record (see the module docstring).
_CHECKED_ATTR = "_anyattn_checked"


def check_slot_and_scale_values(
    op: str,
    num_tokens: int,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    fp8: bool,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """Check the values of `slot_mapping[:num_tokens]` and of the scales not known valid yet.

    Args:
        op: the calling op's name, the prefix of every message.
        num_tokens: how many leading entries of `slot_mapping` are read.
        kv_cache: `(num_blocks, 2, block_size, num_kv_heads, head_size)`, any strides; gives the
            number of slots and the device.
        slot_mapping: int64 `[>= num_tokens]` on the cache's device.
        fp8: whether the cache is fp8 (scales finite and > 0) or not (scales all 1).
        k_scale, v_scale: float32 `[]` or `[num_kv_heads]` on the cache's device, or None (not
            checked).

    Raises:
        ValueError: a slot out of range or used twice, or a scale with a bad value.

    At most one device-to-host transfer, for the tensors not checked unchanged before; none while
    a CUDA graph is being captured (a sync is illegal there), when the checks are skipped.
    """
    if kv_cache.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    num_slots = kv_cache.shape[0] * kv_cache.shape[2]
    scale_check = "fp8 scale" if fp8 else "unit scale"
    # What is not known valid yet (None: nothing to check).
    is_slots_known = _is_known_valid(slot_mapping, "slot_mapping", num_tokens, num_slots)
    slots = None if is_slots_known else slot_mapping[:num_tokens]
    scales = [
        None if scale is None or _is_known_valid(scale, scale_check) else scale
        for scale in (k_scale, v_scale)
    ]
    if slots is None and scales == [None, None]:
        return
    if kv_cache.device.type == "cpu":
        # On the CPU a few Python checks cost less than a dozen tiny tensor ops.
        bad = _find_bad_values_on_cpu(slots, num_slots, fp8, *scales)
    else:
        bad = _find_bad_values_on_device(slots, num_slots, fp8, *scales)
    _raise_for(op, *bad, num_slots, fp8)
    if slots is not None:
        _mark_valid(slot_mapping, "slot_mapping", num_tokens, num_slots)
    for scale in scales:
        if scale is not None:
            _mark_valid(scale, scale_check)


@dataclass(frozen=True, slots=True)
class _Checked:
    """A successful value check, recorded on the checked tensor as `_anyattn_checked`."""

    check: str  # "slot_mapping", "fp8 scale" (finite, > 0) or "unit scale" (all 1)
    state: tuple[object, ...]  # `_tensor_state` when checked
    num_tokens: int = 0  # slot_mapping: its first num_tokens entries are valid
    num_slots: int = 0  # ... for a cache of num_slots slots


def _tensor_state(x: torch.Tensor) -> tuple[object, ...] | None:
    # None: an inference tensor has no version counter, so a change to it cannot be seen.
    if x.is_inference():
        return None
    return (x._version, x.data_ptr(), tuple(x.shape), x.stride())


def _is_known_valid(x: torch.Tensor, check: str, num_tokens: int = 0, num_slots: int = 0) -> bool:
    record = getattr(x, _CHECKED_ATTR, None)
    state = _tensor_state(x)
    # Slots valid for n tokens and m slots stay valid for fewer tokens or a bigger cache.
    return (
        isinstance(record, _Checked)
        and state is not None
        and (record.check, record.state) == (check, state)
        and num_tokens <= record.num_tokens
        and num_slots >= record.num_slots
    )


def _mark_valid(x: torch.Tensor, check: str, num_tokens: int = 0, num_slots: int = 0) -> None:
    state = _tensor_state(x)
    if state is not None:
        setattr(x, _CHECKED_ATTR, _Checked(check, state, num_tokens, num_slots))


def _find_bad_values_on_device(
    slots: torch.Tensor | None,
    num_slots: int,
    fp8: bool,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> tuple[bool, bool, bool, bool]:
    """`(bad_range, duplicate, bad_k_scale, bad_v_scale)`; None arguments are not checked."""
    flags: dict[str, torch.Tensor] = {}
    if slots is not None:
        flags["range"] = ((slots < -1) | (slots >= num_slots)).any()
        # Duplicates are neighbours once sorted; -1 (padding) may repeat.
        ordered = torch.sort(slots).values
        flags["duplicate"] = ((ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)).any()
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is not None and fp8:
            flags[name] = ~(torch.isfinite(scale) & (scale > 0)).all()
        elif scale is not None:
            flags[name] = (scale != 1).any()
    if not flags:
        return False, False, False, False
    # One device-to-host transfer for every check still to make.
    found = dict(zip(flags, torch.stack(list(flags.values())).tolist(), strict=True))
    names = ("range", "duplicate", "k_scale", "v_scale")
    bad_range, duplicate, bad_k_scale, bad_v_scale = (found.get(name, False) for name in names)
    return bad_range, duplicate, bad_k_scale, bad_v_scale


def _find_bad_values_on_cpu(
    slots: torch.Tensor | None,
    num_slots: int,
    fp8: bool,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> tuple[bool, bool, bool, bool]:
    """As `_find_bad_values_on_device`, with Python checks on host values."""
    values = [] if slots is None else slots.tolist()
    real = [v for v in values if v != -1]
    bad_range = bool(values) and (min(values) < -1 or max(values) >= num_slots)
    duplicate = len(set(real)) != len(real)
    bad_scales = []
    for scale in (k_scale, v_scale):
        scale_values = [] if scale is None else scale.reshape(-1).tolist()
        if fp8:
            bad_scales.append(not all(math.isfinite(x) and x > 0 for x in scale_values))
        else:
            bad_scales.append(any(x != 1 for x in scale_values))
    return bad_range, duplicate, bad_scales[0], bad_scales[1]


def _raise_for(
    op: str, bad_range: bool, duplicate: bool, bad_k_scale: bool, bad_v_scale: bool,
    num_slots: int, fp8: bool,
) -> None:  # fmt: skip
    if bad_range:
        raise ValueError(
            f"{op}: slot_mapping has a slot out of range (got a slot < -1 or >= num_blocks * "
            f"block_size = {num_slots}, expected -1 for padding or 0 <= slot < {num_slots})."
        )
    if duplicate:
        raise ValueError(
            f"{op}: slot_mapping gives the same slot to two tokens (got a repeated slot, "
            "expected distinct slots, -1 excepted). Check the block table the slots were built "
            "from."
        )
    for name, bad in (("k_scale", bad_k_scale), ("v_scale", bad_v_scale)):
        if bad and fp8:
            raise ValueError(
                f"{op}: {name} has a bad value for an fp8 cache (got a scale <= 0 or not "
                "finite, expected finite scales > 0)."
            )
        if bad:
            raise ValueError(
                f"{op}: {name} is not 1 for a non-fp8 cache (got a scale other than 1, "
                "expected None or ones, since only fp8 caches are scaled). Use an fp8 "
                "kv_cache_dtype or drop the scale."
            )
