"""IncrementalDetokenizer: streamed text equals a decode of all the tokens, with short windows.

Two tokenizers trained here on a few sentences (no downloads): a byte-level BPE (GPT-2 /
SmolLM2 style: multi-byte characters split across tokens) and a SentencePiece-style BPE (the
first token of a decode loses its leading space).
"""

from __future__ import annotations

import random

import pytest
from tokenizers import (
    SentencePieceBPETokenizer,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    trainers,
)

from anyattn.engine.detokenizer import IncrementalDetokenizer
from anyattn.engine.sampling_params import SamplingParams

CORPUS = [
    "Hello world, héllo wörld! The quick brown fox jumps over the lazy dog.",
    "日本語のテキストを書きます。 Ελληνικά κείμενα. Русский текст.",
    "Emoji: 🙂🎉👍🏽 and naïve café déjà vu, 1234567890.",
]
TEXTS = [
    "Hello world! The fox 🦊 says 日本語.",
    " leading space, then naïve café 🙂🙂🙂",
    "Ελληνικά and Русский текст 👍🏽 end.",
    "plain ascii only, nothing special",
    "🎉",
]


def byte_level_tokenizer(vocab_size: int = 300) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 5, trainer)
    return tokenizer


def sentencepiece_tokenizer() -> Tokenizer:
    tokenizer = SentencePieceBPETokenizer()
    tokenizer.train_from_iterator(
        CORPUS * 5, vocab_size=200, special_tokens=["<eos>", "<unk>"], show_progress=False
    )
    return tokenizer


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return byte_level_tokenizer() if request.param == "byte_level" else sentencepiece_tokenizer()


def stream(tokenizer, ids: list[int], chunk: int) -> tuple[list[str], IncrementalDetokenizer]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    deltas = []
    for start in range(0, len(ids), chunk):
        deltas.append(detokenizer.append(ids[start : start + chunk]))
        assert full.startswith(detokenizer.text)  # settled text never changes
    deltas.append(detokenizer.flush())
    return deltas, detokenizer


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_streamed_text_equals_the_full_decode(tokenizer, chunk: int) -> None:
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        deltas, detokenizer = stream(tokenizer, ids, chunk)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(deltas) == detokenizer.text == full
        assert "\ufffd" not in "".join(deltas)  # no half characters ever shown


def test_split_multibyte_characters_are_held_until_complete() -> None:
    tokenizer = byte_level_tokenizer()
    ids = tokenizer.encode("🙂").ids
    assert len(ids) > 1  # the emoji's four bytes span several tokens
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.append([i]) for i in ids] == [""] * (len(ids) - 1) + ["🙂"]


def test_random_tokens_and_special_tokens_equal_the_full_decode(tokenizer) -> None:
    rng = random.Random(0)
    vocab = tokenizer.get_vocab_size()
    eos = tokenizer.token_to_id("<eos>")
    for _ in range(50):
        # arbitrary byte sequences: invalid UTF-8 included; now and then the special token
        ids = [rng.randrange(vocab) if rng.random() > 0.05 else eos for _ in range(40)]
        deltas, detokenizer = stream(tokenizer, ids, rng.choice([1, 2, 5]))
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
        assert "<eos>" not in detokenizer.text


def test_each_step_decodes_a_short_window() -> None:
    tokenizer = byte_level_tokenizer()
    windows: list[int] = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            windows.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tokenizer.encode(" ".join(TEXTS) * 20).ids
    deltas, _ = stream(Counting(), ids, 1)
    assert len(ids) > 500
    windows = windows[1:]  # the first is `stream`'s reference decode of everything
    assert len(windows) <= 2 * len(ids) + 2 and max(windows) <= 8  # not the whole output
    assert "".join(deltas) == tokenizer.decode(ids)


def test_llm_streams_and_returns_the_full_decode(tiny_llm) -> None:
    transformers = pytest.importorskip("transformers")
    llm, _ = tiny_llm("llama")
    # Model ids < 160 are mostly single bytes of this tokenizer, many of them pieces of
    # multi-byte characters: random sampling makes split and invalid UTF-8 alike.
    llm.tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer())
    params = [
        SamplingParams(temperature=1.5, seed=seed, max_tokens=24, ignore_eos=True)
        for seed in range(4)
    ]
    prompts = [[5, 9, 17, 33], [120, 130, 140], [99], [150, 151, 152, 153, 154]]

    def decode(ids: list[int]) -> str:
        return llm.tokenizer.decode(ids, skip_special_tokens=True)

    for prompt, p in zip(prompts, params, strict=True):
        streamed = "".join(llm.stream(prompt, p))
        ids = llm.last_stream_output.outputs[0].token_ids
        assert len(ids) == 24
        assert streamed == llm.last_stream_output.outputs[0].text == decode(ids)
    outputs = llm.generate(prompts, params)
    for output in outputs:
        assert output.outputs[0].text == decode(output.outputs[0].token_ids)
