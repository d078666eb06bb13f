"""CPU float32 matmul forms over the default model's weights, at a few row counts.

What `anyattn.engine.models.linear.Linear` chooses from: for each row count (tokens in a step)
the time of every linear of one decode step (30 layers of distinct q/k/v, o, gate/up and down
weights, so that each is read from memory as in the model, plus the LM head), for

- `x @ W.T`, column-major W: `F.linear` over a column-major weight (the one-row path);
- `x @ W.T`, row-major W: `F.linear` over the checkpoint's layout (what transformers runs);
- `W @ x.T`, row-major W: `torch.mm(W, x.T)`, transposed back (the path from two rows on).

Random weights of SmolLM2-135M's shapes (hidden 576, intermediate 1536, 9 query and 3 KV heads
of 64, vocabulary 49152, 30 layers); the forms interleaved, best of `--repeats` rounds.

Run: `python benchmarks/cpu_linear.py [--rows 1 2 8 64] [--repeats 8]`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

HIDDEN, INTERMEDIATE, QKV, LAYERS, VOCAB = 576, 1536, 960, 30, 49152
# name -> [out_features, in_features]
SHAPES = {
    "qkv": (QKV, HIDDEN),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (2 * INTERMEDIATE, HIDDEN),
    "down": (HIDDEN, INTERMEDIATE),
}

Form = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
FORMS: dict[str, tuple[str, Form]] = {
    "x @ W.T, column-major W": ("cols", F.linear),
    "x @ W.T, row-major W": ("rows", F.linear),
    "W @ x.T, row-major W": ("rows", lambda x, w: torch.mm(w, x.t()).t()),
}


def _step_ms(weights: list[dict[str, torch.Tensor]], rows: int, form: Form) -> tuple[float, float]:
    """One step's linears with `rows` input rows: (every layer's, the head's) time in ms."""
    inputs = {
        n: torch.randn(rows, w.shape[1]) for layer in weights[::-1][:2] for n, w in layer.items()
    }
    times = []
    for part in (weights[:-1], weights[-1:]):
        start = time.perf_counter()
        for layer in part:
            for name, weight in layer.items():
                form(inputs[name], weight)
        times.append((time.perf_counter() - start) * 1e3)
    return times[0], times[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 64])
    parser.add_argument("--repeats", type=int, default=8, help="best of this many rounds")
    args = parser.parse_args()

    torch.manual_seed(0)
    rows_major = [{n: torch.randn(*s) for n, s in SHAPES.items()} for _ in range(LAYERS)]
    rows_major.append({"head": torch.randn(VOCAB, HIDDEN)})
    # the same values, column-major: the transpose of a row-major [in, out] matrix
    layouts = {
        "rows": rows_major,
        "cols": [{n: w.t().contiguous().t() for n, w in layer.items()} for layer in rows_major],
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32")
    print("ms per step: 30 layers' linears + LM head")
    print(f"{'rows':>4}  " + "  ".join(f"{name:>26}" for name in FORMS))
    for rows in args.rows:
        best = {name: (float("inf"), float("inf")) for name in FORMS}
        for _ in range(args.repeats):
            for name, (layout, form) in FORMS.items():
                layers, head = _step_ms(layouts[layout], rows, form)
                best[name] = (min(best[name][0], layers), min(best[name][1], head))
        cells = [f"{layers:.1f} + {head:.1f}" for layers, head in best.values()]
        print(f"{rows:>4}  " + "  ".join(f"{cell:>26}" for cell in cells))


if __name__ == "__main__":
    main()
