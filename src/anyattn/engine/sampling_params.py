"""SamplingParams: how one request turns logits into tokens, and when it stops (vLLM's fields
and defaults, each checked on construction)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

__all__ = ["GREEDY_TEMPERATURE", "SamplingParams"]

# Below it sampling is greedy: a tiny temperature overflows float32 and is argmax anyway (vLLM's).
GREEDY_TEMPERATURE = 1e-5

# torch.Generator.manual_seed accepts exactly this range.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


def _error(field: str, expected: str, value: object, hint: str = "") -> ValueError:
    message = f"SamplingParams: {field} must be {expected} (got {value!r})."
    return ValueError(f"{message} {hint}" if hint else message)


# numbers.*: numpy scalars are accepted too; bool never is.
def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling and stopping settings of one request (ValueError for a bad field).

    Attributes:
        temperature: divides the logits before sampling; 0 (below `GREEDY_TEMPERATURE`): greedy.
        top_k: keep the k most likely tokens; 0 or -1 (stored as 0): off.
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p (at
            least one), after top_k; 1.0: off.
        seed: seeds the request's own generator, so its tokens do not depend on the rest of the
            batch; None: torch's global generator.
        max_tokens: the most tokens to generate (finish reason "length").
        stop: strings that end the output text (finish reason "stop"; the text is cut before
            them); a str or a list, stored as a tuple.
        stop_token_ids: token ids that end generation (finish reason "stop"; the token is kept
            in the output ids); stored as a tuple.
        ignore_eos: keep generating past the model's end-of-sequence tokens.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or t < 0:
            raise _error("temperature", "a finite number >= 0", t, "Use 0 for greedy decoding.")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _error("top_k", "an int >= 1, or 0 / -1 for off", self.top_k)
        p = self.top_p
        if not _is_number(p) or not 0 < p <= 1:
            raise _error("top_p", "a number in (0, 1]", p, "Use 1.0 to turn nucleus sampling off.")
        seed = self.seed
        if seed is not None and (not _is_int(seed) or not _SEED_MIN <= seed <= _SEED_MAX):
            raise _error("seed", "None or an int in [-2**63, 2**64 - 1]", seed)
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise _error("max_tokens", "an int >= 1", self.max_tokens)
        if not isinstance(self.ignore_eos, bool):
            raise _error("ignore_eos", "a bool", self.ignore_eos)
        set_ = object.__setattr__  # frozen: normalised values are written through it
        set_(self, "temperature", float(t))
        set_(self, "top_p", float(p))
        set_(self, "top_k", max(int(self.top_k), 0))
        set_(self, "max_tokens", int(self.max_tokens))
        set_(self, "seed", None if seed is None else int(seed))
        set_(self, "stop", _normalise_stop(self.stop))
        set_(self, "stop_token_ids", _normalise_stop_token_ids(self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        """True when the request decodes greedily (temperature below `GREEDY_TEMPERATURE`)."""
        return self.temperature < GREEDY_TEMPERATURE


def _normalise_stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
        raise _error("stop", "None, a non-empty str or a list of non-empty str", stop)
    return tuple(stop)


def _normalise_stop_token_ids(ids: object) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, list | tuple) or not all(_is_int(i) and i >= 0 for i in ids):
        raise _error("stop_token_ids", "None or a list of ints >= 0", ids)
    return tuple(int(i) for i in ids)
