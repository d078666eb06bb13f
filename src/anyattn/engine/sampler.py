"""Sampler: logits to tokens, with greedy, temperature, top-k, top-p and per-request seeds."""

from __future__ import annotations

from collections.abc import Sequence as ParamsList

import torch

from anyattn.async_copy import to_device
from anyattn.engine.sampling_params import SamplingParams

__all__ = ["Sampler", "make_generator"]


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """The request's own generator, seeded from `params.seed` (None when unseeded); made once
    per request and passed to every `Sampler` call for it."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


class Sampler:
    """Turns one row of logits per request into one token per request.

    Greedy rows (temperature 0) take the argmax of the raw logits (the first index on a tie).
    Other rows: logits / temperature, then top-k, then top-p over the renormalised survivors
    (at least one token kept), then one draw from the softmax with the request's generator, so
    that a seeded request's tokens depend on nothing else in the batch.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        params: ParamsList[SamplingParams],
        generators: ParamsList[torch.Generator | None],
    ) -> list[int]:
        """One token id per row of float `logits` `[num_reqs, vocab_size]`, each row with its
        `SamplingParams` and generator (on `logits.device`; None: torch's global one).
        ValueError when the shapes or list lengths do not agree."""
        return self.sample(logits, params, generators).tolist()

    def sample(
        self,
        logits: torch.Tensor,
        params: ParamsList[SamplingParams],
        generators: ParamsList[torch.Generator | None],
    ) -> torch.Tensor:
        """`__call__`'s tokens as an int64 tensor `[num_reqs]` on `logits.device`, nothing read
        back."""
        if logits.dim() != 2 or not logits.is_floating_point():
            raise ValueError(
                f"Sampler: logits must be a float tensor [num_reqs, vocab_size] (got "
                f"{logits.dtype} with shape {tuple(logits.shape)})."
            )
        num_reqs = logits.shape[0]
        if len(params) != num_reqs or len(generators) != num_reqs:
            raise ValueError(
                f"Sampler: params and generators need one entry per logits row (got "
                f"{len(params)} and {len(generators)}, expected {num_reqs})."
            )
        if num_reqs == 0:
            return torch.zeros(0, dtype=torch.long, device=logits.device)
        logits = logits.float()
        tokens = logits.argmax(dim=-1)  # the greedy answer; sampled rows overwrite theirs
        rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if rows:
            device = logits.device
            index = _on(device, rows)
            chosen = [params[i] for i in rows]
            temperature = _on(device, [p.temperature for p in chosen], torch.float32)
            # logits: [num_sampled, vocab_size]
            scaled = logits.index_select(0, index) / temperature.unsqueeze(1)
            probs = torch.softmax(_apply_top_k_top_p(scaled, chosen), dim=-1)
            sampled = _draw(probs, [generators[i] for i in rows])
            tokens.index_copy_(0, index, sampled)
        return tokens


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Set the logits that top-k / top-p drop to -inf; rows needing neither pass through."""
    vocab_size = logits.shape[1]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_p = [p.top_p if p.top_p < 1.0 else 2.0 for p in params]
    if all(k == vocab_size for k in top_k) and all(p > 1.0 for p in top_p):
        return logits
    device = logits.device
    # stable: equal logits keep index order, so top-k 1 picks argmax's token
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    position = torch.arange(vocab_size, device=device)
    drop = position >= _on(device, top_k).unsqueeze(1)  # [num_rows, vocab_size]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # a token is kept while the mass ranked above it is < top_p
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= _on(device, top_p, torch.float32).unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One multinomial draw per row, each row from its own generator."""
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        index = _on(probs.device, unseeded)
        drawn = torch.multinomial(probs.index_select(0, index), 1).squeeze(1)
        out.index_copy_(0, index, drawn)
    for i, generator in enumerate(generators):
        if generator is not None:
            out[i] = torch.multinomial(probs[i], 1, generator=generator)[0]
    return out


def _on(device: torch.device, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Per-row values as a tensor on `device`, copied without waiting for queued work."""
    return to_device(torch.tensor(values, dtype=dtype), device)
