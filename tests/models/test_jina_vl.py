"""jina-reranker-m0 (`JinaVLForRanking`) against a reference written from its published
definition on transformers' `Qwen2VLForConditionalGeneration` (same random weights, tiny
config): the pair written "**Document**:\\n{document}\\n**Query**:\\n{query}" (an image side
as its placeholder), the score token (id 100) appended, `score` (Linear, ReLU, Linear) on the
last row, `sigmoid(logit - 2.65)`. Text and image documents, and documents of text and image
parts, in one call; `score` and `rerank`; raw logits (`use_activation=False`); errors that
name the pair and its side.

Tolerance: 1e-5 of the largest value (`assert_rel_close`), fp32 on the CPU: the same
arithmetic as transformers in other kernel shapes (flat batches, the patch convolution as a
matrix product).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from torch import nn

import vecpool
from tests.helpers import assert_rel_close
from tests.image_models import randomize
from tests.models.test_qwen2_vl import (
    MERGE,
    SPECIALS,
    hf_processor,
    sample_images,
    tiny_image_processor,
    tiny_qwen2_vl_config,
)
from vecpool.errors import InputError

WORDS = "<unk> ** Document **: Query a photo of cat dog red house on the".split()
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_TOKEN = SPECIALS.index("<|image_pad|>")
SCORE_TOKEN = 100
LOGIT_BIAS = 2.65


def _tokenizer() -> Tokenizer:
    vocab = {token: i for i, token in enumerate([*SPECIALS, *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tokenizer


class PublishedJinaVL(transformers.Qwen2VLForConditionalGeneration):
    """`JinaVLForRanking` as jina-reranker-m0's modeling.py defines it: no language-model
    head, `score` on the last token's final hidden state, `sigmoid(logit - 2.65)`."""

    def __init__(self, config: Any):
        config.tie_word_embeddings = False
        super().__init__(config)
        self.lm_head = nn.Identity()
        hidden = config.text_config.hidden_size
        self.score = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.post_init()

    def logits(self, **inputs: Any) -> torch.Tensor:
        """The score head's logit less the bias (the published forward before its sigmoid)."""
        out = super().forward(**inputs, use_cache=False, output_hidden_states=True)
        return self.score(out.hidden_states[-1][:, -1]).squeeze(-1) - LOGIT_BIAS


def save_tiny_jina_vl(path: Path) -> PublishedJinaVL:
    """A tiny jina-reranker-m0 folder at `path` (fp32), and the reference on its weights."""
    config = tiny_qwen2_vl_config(SPECIALS, vocab_size=128)  # the score token, 100, inside
    model = PublishedJinaVL(config)
    config._attn_implementation = "eager"
    randomize(model)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    saved = json.loads((path / "config.json").read_text())
    saved["architectures"] = ["JinaVLForRanking"]
    (path / "config.json").write_text(json.dumps(saved))
    tiny_image_processor().save_pretrained(str(path))
    _tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return model


def reference(
    hf: PublishedJinaVL, path: Path, query: str, document: str, images: list[Any]
) -> float:
    """The published model's logit (less the bias) for one pair: the prompt as its
    `formatting_prompts_func` writes it, placeholders grown as Qwen2-VL's processor grows
    them, the score token appended."""
    ids = _tokenizer().encode(f"**Document**:\n{document}\n**Query**:\n{query}").ids
    inputs: dict[str, Any] = {}
    if images:
        pixels = hf_processor(path)(images=images, return_tensors="pt")
        counts = (pixels["image_grid_thw"].prod(-1) // MERGE**2).tolist()
        grown: list[int] = []
        for token in ids:
            grown += [token] * (counts.pop(0) if token == IMAGE_TOKEN else 1)
        ids = grown
        inputs = dict(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
    ids = [*ids, SCORE_TOKEN]
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        return float(
            hf.logits(
                input_ids=input_ids, mm_token_type_ids=(input_ids == IMAGE_TOKEN).int(), **inputs
            )[0]
        )


@pytest.fixture(scope="module")
def m0(tmp_path_factory: pytest.TempPathFactory) -> tuple[vecpool.Engine, PublishedJinaVL, Path]:
    path = tmp_path_factory.mktemp("jina_vl") / "model"
    hf = save_tiny_jina_vl(path)
    return vecpool.Engine(path, device="cpu"), hf, path


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def test_reference_reads_the_final_normed_row(m0: Any) -> None:
    """The published code takes `hidden_states[-1]`: transformers' final (normed) state."""
    _, hf, _ = m0
    ids = torch.tensor([[10, 11, 12, SCORE_TOKEN]])
    with torch.no_grad():
        out = hf(input_ids=ids, use_cache=False, output_hidden_states=True)
        last = hf.model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(out.hidden_states[-1], last, rtol=0, atol=0)


def test_text_and_image_documents_in_one_call_equal_the_reference(m0: Any) -> None:
    engine, hf, path = m0
    a, b = sample_images([(40, 27), (64, 64)], seed=3)
    query = "a red cat"
    documents: list[Any] = [
        "a photo of the dog",
        a,  # an image alone
        {"image": b},
        [{"type": "text", "text": "house "}, {"type": "image", "image": a}],  # parts
        "the house on the cat",
        {"text": " on the house", "image": b},  # the image, then the text
    ]
    expected = np.array(
        [
            reference(hf, path, query, "a photo of the dog", []),
            reference(hf, path, query, IMAGE, [a]),
            reference(hf, path, query, IMAGE, [b]),
            reference(hf, path, query, f"house {IMAGE}", [a]),
            reference(hf, path, query, "the house on the cat", []),
            reference(hf, path, query, f"{IMAGE} on the house", [b]),
        ],
        dtype=np.float32,
    )
    raw = engine.score(query, documents, use_activation=False)
    assert_rel_close(raw, expected)
    scores = engine.score(query, documents)
    assert_rel_close(scores, sigmoid(expected))
    assert np.all((scores > 0) & (scores < 1))
    ranked = engine.rerank(query, documents)
    assert [i for i, _ in ranked] == list(np.argsort(-scores, kind="stable"))
    np.testing.assert_array_equal([s for _, s in ranked], np.sort(scores)[::-1])
    # One pair alone gives what it gives among the others (within rounding: other steps).
    assert_rel_close(engine.score(query, [documents[3]]), scores[3:4])


def test_pairs_in_order_with_an_image_query(m0: Any) -> None:
    """N -> N pairs; an image on the query side goes after the document's (the prompt's
    order), as the published code orders them."""
    engine, hf, path = m0
    a, b = sample_images([(33, 40), (28, 28)], seed=5)
    out = engine.score(
        [{"image": a}, "the dog"], [{"image": b}, "on the red house"], use_activation=False
    )
    expected = [
        _reference_images_in_order(hf, path, a, b),
        reference(hf, path, "the dog", "on the red house", []),
    ]
    assert_rel_close(out, np.array(expected, dtype=np.float32))


def _reference_images_in_order(
    hf: PublishedJinaVL, path: Path, query: Image.Image, doc: Image.Image
) -> float:
    ids = _tokenizer().encode(f"**Document**:\n{IMAGE}\n**Query**:\n{IMAGE}").ids
    pixels = hf_processor(path)(images=[doc, query], return_tensors="pt")
    counts = (pixels["image_grid_thw"].prod(-1) // MERGE**2).tolist()
    grown: list[int] = []
    for token in ids:
        grown += [token] * (counts.pop(0) if token == IMAGE_TOKEN else 1)
    input_ids = torch.tensor([[*grown, SCORE_TOKEN]])
    with torch.no_grad():
        return float(
            hf.logits(
                input_ids=input_ids,
                mm_token_type_ids=(input_ids == IMAGE_TOKEN).int(),
                pixel_values=pixels["pixel_values"],
                image_grid_thw=pixels["image_grid_thw"],
            )[0]
        )


def test_truncation_cuts_a_text_document_and_keeps_the_score_token(m0: Any) -> None:
    engine, hf, path = m0
    query, document = "a cat", "the red house on the dog of the photo"
    full = len(_tokenizer().encode(f"**Document**:\n{document}\n**Query**:\n{query}").ids) + 1
    out = engine.score(query, [document], truncate_prompt_tokens=full - 3, use_activation=False)
    cut = "the red house on the dog"  # three tokens fewer
    assert_rel_close(out, np.array([reference(hf, path, query, cut, [])], dtype=np.float32))


def test_the_published_checkpoint_layout_loads(m0: Any, tmp_path: Path) -> None:
    """jina-reranker-m0's files keep transformers 4's names (`model.layers.`, `visual.`,
    `score.`) and the language model's settings at the top of config.json; an `lm_head`
    saved beside them is left unused."""
    engine, _, path = m0
    old = tmp_path / "old"
    old.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        (old / name).write_bytes((path / name).read_bytes())
    tensors = load_file(str(path / "model.safetensors"))
    renamed = {
        k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v
        for k, v in tensors.items()
    }
    renamed["lm_head.weight"] = torch.zeros(128, 32)
    save_file(renamed, str(old / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    config.update(text)
    config["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    config["rope_theta"] = rope["rope_theta"]
    (old / "config.json").write_text(json.dumps(config))
    (image,) = sample_images([(40, 27)], seed=7)
    documents = ["the dog", {"image": image}]
    published = vecpool.Engine(old, device="cpu")
    np.testing.assert_array_equal(
        published.score("a cat", documents), engine.score("a cat", documents)
    )


def test_max_tokens_per_doc_cuts_text_documents_only(m0: Any) -> None:
    """Cohere's rule: each text document cut to its first tokens before it is written into the
    pair; a document of parts (an image among them) is left whole. The same inputs in one
    call: the same step, so the same bits."""
    engine, _, _ = m0
    (image,) = sample_images([(40, 27)], seed=6)
    parts = [{"type": "text", "text": "the red house"}, {"type": "image", "image": image}]
    long = "the red house on the dog of the photo"
    ranked = dict(engine.rerank("a cat", [long, parts], max_tokens_per_doc=3))
    expected = engine.score("a cat", ["the red house", parts])
    np.testing.assert_array_equal([ranked[0], ranked[1]], expected)


def test_bad_sides_fail_naming_the_pair_and_side(m0: Any) -> None:
    engine, _, _ = m0
    (image,) = sample_images([(40, 27)], seed=1)
    with pytest.raises(InputError, match=r"input 1.*a side is a string") as info:
        engine.score("a cat", ["the dog", 3.5])
    assert (info.value.index, info.value.field) == (1, "text_2")
    with pytest.raises(InputError, match=r"not an image") as info:
        engine.score("a cat", ["the dog", {"image": b"not an image"}])
    assert (info.value.index, info.value.field) == (1, "text_2")
    with pytest.raises(InputError, match=r"part 0") as info:
        engine.rerank("a cat", ["the dog", [{"type": "video", "video": "x"}]])
    assert (info.value.index, info.value.field) == (1, "documents")
    with pytest.raises(InputError, match=r"a side is a string") as info:
        engine.rerank({"video": "x"}, ["the dog"])
    assert info.value.field == "query"
    # The engine goes on.
    assert engine.score("a cat", [image, "the dog"]).shape == (2,)
