"""GGUF files (llama.cpp's format) as a `config.json`-shaped dict and a lazy stream of
`(hf_name, tensor)` in the Hugging Face layout (`read_gguf`), plus the tokenizer with its chat
template (`load_gguf_tokenizer`). Beyond renaming: the interleaved rows of each Q and K head of
llama models are put back in HF order, and Gemma2's stored `1 + w` norm weights lose the 1.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from anyattn.engine.model_config import SUPPORTED_ARCHITECTURES as HF_ARCHITECTURES
from anyattn.engine.models.weights import CountedWeights

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma2")
_Q = gguf.GGMLQuantizationType
SUPPORTED_QUANT_TYPES = (_Q.F32, _Q.F16, _Q.BF16, _Q.Q4_0, _Q.Q4_1, _Q.Q8_0)
_MAGIC = b"GGUF"

# Per-layer GGUF tensor names (after "blk.N.") -> HF names (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma2 has four norms per layer; llama.cpp's "ffn_norm" is the one before the MLP there.
_GEMMA2_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Consumed into the config (Llama 3 RoPE scaling), not a model parameter.
_CONFIG_ONLY_TENSORS = {"rope_freqs.weight"}


def read_gguf(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32
) -> tuple[dict[str, Any], CountedWeights]:
    """`(config, tensors)` of a GGUF file of `SUPPORTED_ARCHITECTURES` (Llama, SmolLM and
    Mistral files say "llama") with tensors of `SUPPORTED_QUANT_TYPES`: a dict with the keys of
    a Hugging Face `config.json`, and a lazy stream of `(HF name, tensor)` in HF shapes and
    `dtype`, dequantised in float32 first (no `lm_head.weight` when the embeddings are tied).
    FileNotFoundError: no such file. ValueError: not a GGUF file, a truncated or corrupt one,
    an unsupported architecture or tensor type, an unknown tensor, a non-float dtype."""
    if not dtype.is_floating_point:
        raise ValueError(f"read_gguf: dtype must be a floating dtype, got {dtype}")
    reader = _open_reader(path)
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{path}: GGUF metadata lacks the string 'general.architecture'")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    by_name = {t.name: t for t in reader.tensors}
    config = _build_config(reader, arch, by_name, path)
    plan = _plan_tensors(reader, arch, config, path)

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for tensor, hf_name, fix in plan:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # float32
            if not array.flags.writeable:  # F32 tensors come back as a view of the mapped file
                array = array.copy()
            values = torch.from_numpy(array)
            # GGUF lists dims fastest-first; torch wants them slowest-first.
            values = values.reshape(tuple(reversed([int(d) for d in tensor.shape])))
            if fix is not None:
                values = fix(values)
            yield hf_name, values.to(dtype).contiguous()

    return config, CountedWeights(stream(), len(plan))


class _Reader(gguf.GGUFReader):
    """`gguf.GGUFReader` over a plain ndarray view of its memory map (slicing an `np.memmap`
    runs Python code per slice, which slows parsing a large vocabulary several times)."""

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray)


def _check_file(path: Path) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != _MAGIC:
        raise ValueError(
            f"{path}: not a GGUF file (starts with {magic!r}, a GGUF file starts with {_MAGIC!r})"
        )


def _open_reader(path: str | os.PathLike[str]) -> gguf.GGUFReader:
    path = Path(path)
    _check_file(path)
    try:
        reader = _Reader(path)
    except Exception as err:
        # a short read fails with whatever it produces (IndexError, reshape errors, ...)
        raise ValueError(f"{path}: truncated or corrupt GGUF file ({err})") from err
    end = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > end:
            raise ValueError(f"{path}: truncated GGUF file (tensor {t.name} runs past the end)")
    return reader


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _f32(value: float) -> float:
    # GGUF stores floats as float32; the shortest float32 repr gives back the decimal written
    # in the original config.json (1e-05, not 9.999999747378752e-06).
    return float(str(np.float32(value)))


def _build_config(
    reader: gguf.GGUFReader, arch: str, by_name: dict[str, Any], path: object
) -> dict[str, Any]:
    def md(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{key}")
        return default if value is None else value

    def required(key: str) -> Any:
        value = md(key)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    if "token_embd.weight" not in by_name:
        raise ValueError(f"{path}: GGUF file lacks the tensor token_embd.weight")
    hidden_size = int(required("embedding_length"))
    num_heads = int(required("attention.head_count"))
    num_kv_heads = md("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        if len(set(num_kv_heads)) != 1:
            raise ValueError(f"{path}: per-layer KV head counts {num_kv_heads} are not supported")
        num_kv_heads = num_kv_heads[0]
    # The tensors are the ground truth for sizes a converter may leave out of the metadata.
    vocab_size = int(by_name["token_embd.weight"].shape[1])
    q = by_name.get("blk.0.attn_q.weight")
    q_rows = hidden_size if q is None else int(q.shape[1])
    head_dim = int(md("attention.key_length", q_rows // num_heads))
    config: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": int(required("feed_forward_length")),
        "num_hidden_layers": int(required("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(required("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(md("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(reader, md, head_dim, path),
        "max_position_embeddings": int(required("context_length")),
        "tie_word_embeddings": "output.weight" not in by_name,
        "attention_bias": "blk.0.attn_q.bias" in by_name,
        "mlp_bias": "blk.0.ffn_up.bias" in by_name,
    }
    for gguf_key, hf_key in (("bos", "bos"), ("eos", "eos"), ("padding", "pad")):
        token_id = _field(reader, f"tokenizer.ggml.{gguf_key}_token_id")
        if token_id is not None:
            config[f"{hf_key}_token_id"] = int(token_id)
    sliding_window = md("attention.sliding_window")
    if sliding_window is not None:
        config["sliding_window"] = int(sliding_window)

    name = (_field(reader, "general.name") or "").lower()
    model_type = arch
    if arch == "llama" and "mistral" in name:
        # llama.cpp files Mistral under "llama"; the name is the only hint left.
        model_type = "mistral"
        config.setdefault("sliding_window", None)
    hf_class = next(cls for cls, kind in HF_ARCHITECTURES.items() if kind == model_type)
    if arch == "gemma2":
        config["hidden_activation"] = "gelu_pytorch_tanh"
        config["attn_logit_softcapping"] = _opt_f32(md("attn_logit_softcapping"))
        config["final_logit_softcapping"] = _opt_f32(md("final_logit_softcapping"))
        # Not stored in GGUF; llama.cpp uses hidden_size / num_heads for the 46-layer (27B)
        # model and head_dim otherwise, so do we.
        is_27b = config["num_hidden_layers"] == 46
        config["query_pre_attn_scalar"] = hidden_size // num_heads if is_27b else head_dim
    return {"architectures": [hf_class], "model_type": model_type, **config}


def _opt_f32(value: float | None) -> float | None:
    return None if value is None else _f32(value)


def _rope_scaling(
    reader: gguf.GGUFReader, md: Callable[..., Any], head_dim: int, path: object
) -> dict[str, Any] | None:
    kind = md("rope.scaling.type", "none")
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(md("rope.scaling.factor"))}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": _f32(md("rope.scaling.factor"))}
        original = md("rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        for key in ("beta_fast", "beta_slow"):
            if (value := md(f"rope.scaling.yarn_{key}")) is not None:
                scaling[key] = _f32(value)
        return scaling
    if kind != "none":
        raise ValueError(f"{path}: unsupported RoPE scaling type {kind!r} (linear, yarn, none)")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    factors = gguf.quants.dequantize(freqs.data, freqs.tensor_type).astype(np.float64).ravel()
    return _llama3_rope_scaling(factors, _f32(md("rope.freq_base", 10000.0)), head_dim, path)


def _llama3_rope_scaling(
    factors: np.ndarray, theta: float, head_dim: int, path: object
) -> dict[str, Any]:
    """HF's "llama3" RoPE parameters from llama.cpp's per-frequency divisors `factors` (1 for
    short wavelengths, `factor` for long ones, a blend linear in 1 / wavelen between, with
    `low_freq_factor = 1`), checked by rebuilding the table."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    # The table is float32 (and may come from a float32 computation): compare loosely.
    factor = round(float(factors.max()), 4)
    mid = (factors > 1 + 1e-4) & (factors < factor * (1 - 1e-4))
    if factor <= 1 or len(factors) != len(inv_freq) or mid.sum() < 2:
        raise ValueError(f"{path}: cannot interpret the rope_freqs table as Llama 3 RoPE scaling")
    smooth = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(1 / wavelen[mid], smooth, 1)  # smooth = slope/wl + intercept
    old_ctx = round(-slope / intercept)
    high = round(1 - 1 / intercept, 4)
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": high,
        "original_max_position_embeddings": old_ctx,
    }
    smooth_all = (old_ctx / wavelen - 1.0) / (high - 1.0)
    rebuilt = np.where(
        wavelen < old_ctx / high,
        1.0,
        np.where(wavelen > old_ctx, factor, 1 / ((1 - smooth_all) / factor + smooth_all)),
    )
    if not np.allclose(rebuilt, factors, rtol=1e-4, atol=0):
        raise ValueError(f"{path}: rope_freqs table does not match Llama 3 RoPE scaling")
    return scaling


def _plan_tensors(
    reader: gguf.GGUFReader, arch: str, config: dict[str, Any], path: object
) -> list[tuple[Any, str, Callable[[torch.Tensor], torch.Tensor] | None]]:
    """Name, fix-up and type check for every tensor, done before any is read."""
    layer_names = _GEMMA2_LAYER_NAMES if arch == "gemma2" else _LAYER_NAMES
    num_heads, num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    plan = []
    for tensor in reader.tensors:
        if tensor.name in _CONFIG_ONLY_TENSORS:
            continue
        if tensor.tensor_type not in SUPPORTED_QUANT_TYPES:
            supported = ", ".join(q.name for q in SUPPORTED_QUANT_TYPES)
            raise ValueError(
                f"{path}: tensor {tensor.name} has unsupported type {tensor.tensor_type.name}; "
                f"supported: {supported}"
            )
        if m := _LAYER_RE.fullmatch(tensor.name):
            layer, kind, suffix = m.groups()
            hf_base = layer_names.get(kind)
            if hf_base is not None:
                hf_base = f"model.layers.{layer}.{hf_base}"
        else:
            base, _, suffix = tensor.name.rpartition(".")
            kind, hf_base = base, _TOP_NAMES.get(base)
        if hf_base is None:
            raise ValueError(f"{path}: unexpected tensor {tensor.name} for architecture {arch!r}")
        fix = None
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            heads = num_heads if kind == "attn_q" else num_kv_heads
            fix = functools.partial(unpermute_qk, num_heads=heads)
        elif arch == "gemma2" and "norm" in kind:
            fix = functools.partial(torch.sub, other=1)
        plan.append((tensor, f"{hf_base}.{suffix}", fix))
    return plan


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: per head, rows (0, d/2, 1, d/2+1, ...) back to (0..d-1).
    `weight`: `[num_heads * head_size, ...]` (a weight or a bias) -> same shape, HF layout."""
    head_size = weight.shape[0] // num_heads
    # weight: [num_heads, head_size // 2, 2, ...] -> [num_heads, 2, head_size // 2, ...]
    w = weight.reshape(num_heads, head_size // 2, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


def load_gguf_tokenizer(
    path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None
) -> Any:
    """The transformers fast tokenizer (with its chat template) stored in a GGUF file, saved
    after its slow conversion under `cache_dir / gguf-tokenizers / <sha256 of the file>`
    (default `$ANYATTN_CACHE_DIR`, else `$XDG_CACHE_HOME/anyattn`, else `~/.cache/anyattn`; an
    unwritable cache only costs speed). FileNotFoundError / ValueError as `read_gguf`."""
    from transformers import AutoTokenizer

    path = Path(path)
    _check_file(path)
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    folder = _cache_root(cache_dir) / "gguf-tokenizers" / digest
    if (folder / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    with contextlib.suppress(OSError):
        folder.parent.mkdir(parents=True, exist_ok=True)
        # written aside and renamed: a concurrent or interrupted run never sees half a folder
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
        try:
            tokenizer.save_pretrained(tmp)
            tmp.rename(folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    if env := os.environ.get("ANYATTN_CACHE_DIR"):
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "anyattn"
