"""Hugging Face folders: config + safetensors (single and sharded), tokenizers, and every way a
folder can be wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from anyattn.engine.hf_loader import load_hf_folder, load_tokenizer
from anyattn.engine.model_config import ModelConfig

transformers = pytest.importorskip("transformers")


@pytest.fixture
def llama_folder(tiny_hf_model, tmp_path: Path) -> Path:
    """A private copy of the tiny Llama folder, safe to damage."""
    source, _ = tiny_hf_model("llama")
    return Path(shutil.copytree(source, tmp_path / "llama"))


def test_loads_config_and_every_tensor(tiny_hf_model):
    folder, hf_model = tiny_hf_model("llama_tied")
    config, weights = load_hf_folder(folder)
    assert config == ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    tensors = dict(weights)
    expected = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    assert len(weights) == len(tensors) == len(expected)
    assert tensors.keys() == expected.keys()
    for name, tensor in tensors.items():
        assert torch.equal(tensor, expected[name]), name


def test_loads_sharded_checkpoint_through_its_index(tiny_hf_model, tmp_path: Path):
    _, hf_model = tiny_hf_model("qwen2")
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    config, weights = load_hf_folder(tmp_path)
    tensors = dict(weights)
    assert tensors.keys() == hf_model.state_dict().keys()
    assert config.attention_bias


def test_missing_path(tmp_path: Path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=r"no such folder .*nowhere.*config\.json"):
        load_hf_folder(missing)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_tokenizer(missing)


def test_a_file_is_not_a_folder(tmp_path: Path):
    file = tmp_path / "model.gguf"
    file.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"not a folder.*GGUF loader"):
        load_hf_folder(file)


def test_no_config_json(llama_folder: Path):
    (llama_folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"no config\.json in .*llama"):
        load_hf_folder(llama_folder)


def test_config_json_not_json(llama_folder: Path):
    (llama_folder / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        load_hf_folder(llama_folder)


def test_unsupported_architecture_lists_supported_ones(llama_folder: Path):
    config = json.loads((llama_folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (llama_folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Gemma2ForCausalLM"):
        load_hf_folder(llama_folder)


def test_no_safetensors(llama_folder: Path):
    (llama_folder / "model.safetensors").rename(llama_folder / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors.*pytorch_model\.bin"):
        load_hf_folder(llama_folder)


@pytest.mark.parametrize("damage", ["truncated", "garbage_header", "empty"])
def test_corrupt_safetensors_names_the_file(llama_folder: Path, damage: str):
    file = llama_folder / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(
        {"truncated": data[: len(data) // 2], "garbage_header": b"\xff" * 64, "empty": b""}[damage]
    )
    with pytest.raises(ValueError, match=r"model\.safetensors.*truncated or corrupt"):
        load_hf_folder(llama_folder)


def test_index_naming_a_missing_shard(llama_folder: Path):
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (llama_folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors"):
        load_hf_folder(llama_folder)


def _word_level_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "hello", "world", "user", "assistant", ":"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}"
    )
    fast.save_pretrained(folder)


def test_tokenizer_and_chat_template(llama_folder: Path):
    _word_level_tokenizer(llama_folder)
    tokenizer = load_tokenizer(llama_folder)
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    assert ids == [3, 4]
    assert tokenizer.decode(ids) == "hello world"
    assert tokenizer.eos_token_id == 2
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "user : hello assistant :"


def test_folder_without_tokenizer(llama_folder: Path):
    with pytest.raises(FileNotFoundError, match=r"no tokenizer files .*tokenizer\.json"):
        load_tokenizer(llama_folder)
