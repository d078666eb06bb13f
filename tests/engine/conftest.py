"""Engine test set-up: tiny random Hugging Face models saved to disk, and a paged step runner.

Fixtures:
    tiny_hf_model: `tiny_hf_model(kind) -> (folder, hf_model)`: a random transformers model of
        one of `TINY_MODELS` (fixed seed, fp32, eager attention) saved with `save_pretrained`
        (safetensors) into a session temp folder, and the model itself as the reference;
        `DEEPSEEK_MODELS` are the DeepSeek-V2/V3 (MLA + MoE) kinds.
    paged_runner: `paged_runner(model, block_size=4, num_blocks=64) -> PagedRunner`.

    tiny_llm: `tiny_llm(kind, **llm_kwargs) -> (LLM, hf_model)` over such a folder with a
        word-level tokenizer ("t0 t1 ..."), so text prompts work.
    hf_logits: `hf_logits(hf_model, token_ids)`: transformers' fp32 logits `[len, vocab]` of
        one sequence (the reference every model test compares with).
    run_step: `run_step(runner, token_ids, num_computed, num_new, block_tables) -> StepOutput`:
        one `ModelRunner.execute` over requests given as lists (an `InputBatch` made for it).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from anyattn.config import BatchLimits
from anyattn.kv_cache import allocate_kv_cache
from anyattn.metadata import make_common_attn_metadata

# Sizes shared by every tiny model: hidden 64, 4 query heads of 16, GQA 2:1, 3 layers.
_SIZES = {
    "vocab_size": 160,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    # Larger than the usual 0.02 so that attention is far from uniform and RoPE, windows and
    # soft caps change the logits visibly.
    "initializer_range": 0.15,
}

# DeepSeek (MLA + MoE): kind -> overrides of DeepseekV2Config / DeepseekV3Config. Every kind
# has 3 layers, the first `first_k_dense_replace` dense; `num_key_value_heads` equals the head
# count (transformers' V3 eager attention needs it); latent sizes L + R odd (48 + 16, 40 + 8)
# and DeepSeek's 512 + 64; value heads smaller or larger than P + R. `head_dim` is the rope size
# R, as transformers' config holds it (a shared value would override the config's own).
_DEEPSEEK = {"num_key_value_heads": 4, "n_routed_experts": 8, "moe_intermediate_size": 16}
DEEPSEEK_MODELS: dict[str, dict] = {
    # V2-Lite-like: no low-rank query, greedy softmax routing, YaRN with mscale = mscale_all_dim
    "deepseek_v2": {
        **_DEEPSEEK,
        "q_lora_rank": None,
        "kv_lora_rank": 48,
        "qk_rope_head_dim": 16,
        "head_dim": 16,
        "qk_nope_head_dim": 16,
        "v_head_dim": 24,
        "num_experts_per_tok": 2,
        "n_shared_experts": 2,
        "first_k_dense_replace": 1,
        "topk_method": "greedy",
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    },
    # V2-like: low-rank query, group-limited greedy routing scaled, plain RoPE
    "deepseek_v2_group": {
        **_DEEPSEEK,
        "q_lora_rank": 32,
        "kv_lora_rank": 40,
        "qk_rope_head_dim": 8,
        "head_dim": 8,
        "qk_nope_head_dim": 24,
        "v_head_dim": 16,
        "num_experts_per_tok": 3,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "topk_method": "group_limited_greedy",
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 1.5,
    },
    # V3-like: sigmoid routing with correction bias, 4 groups keep 2, normalised and scaled;
    # interleaved YaRN with mscale_all_dim (attention factor 1, softmax scale mscale^2)
    "deepseek_v3": {
        **_DEEPSEEK,
        "q_lora_rank": 24,
        "kv_lora_rank": 48,
        "qk_rope_head_dim": 16,
        "head_dim": 16,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "rope_interleave": True,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    },
    # DeepSeek's 512 + 64 latent; NeoX pairing, no renormalisation, 2 dense layers, YaRN whose
    # attention factor is not 1 (mscale != mscale_all_dim)
    "deepseek_v3_512": {
        **_DEEPSEEK,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "head_dim": 64,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 2,
        "n_group": 2,
        "topk_group": 1,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.5,
        "rope_interleave": False,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 16,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
        },
    },
}
# the vocabulary of the default model's tokenizer (SmolLM2), for `anyattn generate` on a folder
DEEPSEEK_MODELS["deepseek_v2_vocab49152"] = {**DEEPSEEK_MODELS["deepseek_v2"], "vocab_size": 49152}

# kind -> (transformers config class name, overrides)
TINY_MODELS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {"num_key_value_heads": 1}),
    # Heads of 64, a size every GPU backend takes (the CUDA-graph tests run it).
    "llama_h64": ("LlamaConfig", {"hidden_size": 256, "head_dim": 64}),
    # SmolLM2-style: tied embeddings; with Llama 3.1 RoPE scaling.
    "llama_tied": (
        "LlamaConfig",
        {
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 50000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "qwen2": ("Qwen2Config", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    # A window shorter than the prompts.
    "mistral": ("MistralConfig", {"sliding_window": 5}),
    # Window 4 on even layers; caps low enough to bite on these activations.
    "gemma2": (
        "Gemma2Config",
        {
            "num_hidden_layers": 4,
            "sliding_window": 4,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
            "query_pre_attn_scalar": 24,
        },
    ),
    **{
        kind: ("DeepseekV2Config" if kind.startswith("deepseek_v2") else "DeepseekV3Config", cfg)
        for kind, cfg in DEEPSEEK_MODELS.items()
    },
}


def make_hf_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """A random fp32 transformers model of `kind`, eager attention, norms and biases randomised
    too (their defaults, ones and zeros, would hide mistakes)."""
    transformers = pytest.importorskip("transformers")
    class_name, overrides = TINY_MODELS[kind]
    config = getattr(transformers, class_name)(**{**_SIZES, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = 0.1 * torch.randn(param.shape, generator=generator)
            if "norm" in name or name.endswith(".bias"):
                param.add_(noise)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros would hide a missing bias
                buffer.add_(0.1 * torch.randn(buffer.shape, generator=generator))
    return model.eval()


@pytest.fixture(scope="session")
def tiny_hf_model(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str], tuple[Path, torch.nn.Module]]:
    cache: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(kind: str) -> tuple[Path, torch.nn.Module]:
        if kind not in cache:
            model = make_hf_model(kind)
            folder = tmp_path_factory.mktemp(f"hf_{kind}")
            model.save_pretrained(folder)
            cache[kind] = (folder, model)
        return cache[kind]

    return get


@torch.inference_mode()
def _hf_logits(hf_model: torch.nn.Module, token_ids: Sequence[int]) -> torch.Tensor:
    return hf_model(input_ids=torch.tensor([list(token_ids)])).logits[0].float()


def run_step(runner, token_ids, num_computed, num_new, block_tables):
    from anyattn.engine.input_batch import InputBatch

    batch, slots = InputBatch.from_lists(token_ids, num_computed, block_tables, runner.block_size)
    return runner.execute(batch, slots, num_new)


@pytest.fixture(name="run_step")
def run_step_fixture():
    return run_step


@pytest.fixture
def hf_logits() -> Callable[[torch.nn.Module, Sequence[int]], torch.Tensor]:
    return _hf_logits


class PagedRunner:
    """Runs a model step by step over paged KV caches, as an engine would: blocks drawn from a
    shuffled pool (block 0 kept as the null block), one metadata per KV-cache group.

    Args:
        model: an `anyattn.engine.models` model.
        block_size: tokens per KV block.
        num_blocks: blocks per layer cache.
    """

    def __init__(self, model: torch.nn.Module, block_size: int = 4, num_blocks: int = 64) -> None:
        self.model = model
        self.block_size = block_size
        limits = BatchLimits(max_num_reqs=8, max_num_tokens=512, max_model_len=256)
        self.caches: dict[str, torch.Tensor] = {}
        groups: dict[tuple, list[str]] = {}
        records = {}
        for layer in model.attention_layers():
            records[layer.layer_name] = layer.impl.layer_params()
            # an AttentionSpec, or an MLAAttentionSpec (one latent row per token)
            spec = layer.kv_cache_spec(block_size, model.dtype, "auto")
            self.caches[layer.layer_name] = allocate_kv_cache(
                layer.backend,
                num_blocks,
                block_size,
                spec.num_kv_heads,
                spec.head_size,
                model.dtype,
            )
            groups.setdefault((layer.backend, spec), []).append(layer.layer_name)
        self.builders = [
            (
                backend.get_builder_cls()(spec, {n: records[n] for n in names}, limits, "cpu"),
                names,
            )
            for (backend, spec), names in groups.items()
        ]
        generator = torch.Generator().manual_seed(1234)
        self.free = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
        self.blocks: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    @torch.inference_mode()
    def step(self, chunks: Sequence[tuple[str, Sequence[int]]]) -> list[torch.Tensor]:
        """Run each request's new tokens (in the given order, decodes first).

        Args:
            chunks: `(request id, new token ids)` per request.

        Returns:
            float32 logits `[len(new tokens), vocab_size]` per request, in order.
        """
        query_lens, seq_lens, input_ids, positions = [], [], [], []
        for rid, tokens in chunks:
            start = self.num_computed.get(rid, 0)
            end = start + len(tokens)
            blocks = self.blocks.setdefault(rid, [])
            while len(blocks) * self.block_size < end:
                blocks.append(self.free.pop())
            self.num_computed[rid] = end
            query_lens.append(len(tokens))
            seq_lens.append(end)
            input_ids.extend(tokens)
            positions.extend(range(start, end))
        width = max(len(self.blocks[rid]) for rid, _ in chunks)
        block_table = torch.zeros(len(chunks), width, dtype=torch.int32)
        for row, (rid, _) in enumerate(chunks):
            block_table[row, : len(self.blocks[rid])] = torch.tensor(self.blocks[rid])
        common = make_common_attn_metadata(query_lens, seq_lens, block_table, self.block_size)
        attn_metadata = {}
        for builder, names in self.builders:
            metadata = builder.build(0, common)
            attn_metadata.update(dict.fromkeys(names, metadata))
        hidden = self.model(
            torch.tensor(input_ids), torch.tensor(positions), attn_metadata, self.caches
        )
        logits = self.model.compute_logits(hidden)
        return list(logits.split(query_lens))


@pytest.fixture
def paged_runner() -> Callable[..., PagedRunner]:
    return PagedRunner


def with_tokenizer(folder: Path, vocab_size: int, tmp_path: Path) -> Path:
    """A copy of a tiny model folder with a word-level tokenizer ("t0 t1 ...") of its vocab."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    target = tmp_path / folder.name
    if target.exists():
        return target
    shutil.copytree(folder, target)
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = pytest.importorskip("transformers").PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="t0"
    )
    fast.save_pretrained(target)
    return target


@pytest.fixture
def tiny_llm(tiny_hf_model, tmp_path):
    """`tiny_llm(kind, max_position_embeddings=None, **llm_kwargs) -> (LLM, hf_model)`: an LLM
    over a tiny random model folder (with a word-level tokenizer), block size 4, fp32, CPU."""

    def make(kind: str, max_position_embeddings: int | None = None, **kwargs):
        folder, hf_model = tiny_hf_model(kind)
        path = with_tokenizer(folder, hf_model.config.vocab_size, tmp_path)
        if max_position_embeddings is not None:  # a longer context than the reference model's
            config = json.loads((path / "config.json").read_text())
            config["max_position_embeddings"] = max_position_embeddings
            path = path.with_name(f"{path.name}_ctx{max_position_embeddings}")
            if not path.exists():
                shutil.copytree(tmp_path / folder.name, path)
            (path / "config.json").write_text(json.dumps(config))
        kwargs.setdefault("block_size", 4)
        kwargs.setdefault("dtype", torch.float32)
        kwargs.setdefault("device", "cpu")
        from anyattn.engine.llm import LLM

        return LLM(path, **kwargs), hf_model

    return make
