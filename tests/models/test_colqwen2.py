"""ColQwen2 (`ColQwen2ForRetrieval`) against transformers on the same random weights, folder and
pixel values: the processor's prompts (a page's image prompt, a query's prefix and
augmentation tokens) token for token, every token's L2-normalised vector for text queries and
page images in one step, and MaxSim scores equal to `ColQwen2Processor.score_retrieval`.

Tolerance: 1e-5 of the largest value (`assert_rel_close`), fp32 on the CPU: the same arithmetic
in other kernel shapes (a flat batch, the patch convolution as one matrix product). Token ids
are compared exactly: the same tokenizer on the same text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers

import vecpool
from tests.helpers import assert_rel_close
from tests.image_models import randomize
from tests.models.test_qwen2_vl import tiny_image_processor, tiny_qwen2_vl_config
from vecpool.errors import InputError
from vecpool.inputs.prompts import TextOptions

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
WORDS = "<unk> \n user Query : Describe the image . a cat dog red house on where is".split(" ")
PATCH, MERGE, DIM = 4, 2, 16
IMAGE_TOKEN = SPECIALS.index("<|image_pad|>")
QUERIES = ["where is the cat", "a red house", "dog"]
SIZES = [(40, 27), (21, 50), (64, 64)]


def retrieval_tokenizer(specials: list[str], words: list[str]) -> Tokenizer:
    """A word-level tokenizer that keeps newlines and punctuation as tokens of their own."""
    vocab = {token: i for i, token in enumerate([*specials, *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(" ", behavior="removed"),
            pre_tokenizers.Split(Regex(r"[^\w]"), behavior="isolated"),
        ]
    )
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tokenizer


def save_tiny_colqwen2(path: Path) -> tuple[Any, Any]:
    """A tiny ColQwen2 folder at `path` (weights, processor, tokenizer); transformers' model
    (fp32, eager attention) and processor read back from it."""
    vlm = tiny_qwen2_vl_config(SPECIALS)
    model = transformers.ColQwen2ForRetrieval(
        transformers.ColQwen2Config(vlm_config=vlm, embedding_dim=DIM)
    )
    randomize(model, seed=0)
    model.save_pretrained(str(path))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=retrieval_tokenizer(SPECIALS, WORDS),
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
    )
    transformers.ColQwen2Processor(
        image_processor=tiny_image_processor(), tokenizer=tokenizer
    ).save_pretrained(str(path))
    hf = transformers.ColQwen2ForRetrieval.from_pretrained(str(path), attn_implementation="eager")
    return hf.eval(), transformers.ColQwen2Processor.from_pretrained(str(path))


def sample_images(sizes: list[tuple[int, int]], seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


@pytest.fixture(scope="module")
def colqwen2(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("colqwen2") / "model"
    hf, processor = save_tiny_colqwen2(path)
    return vecpool.Engine(path, device="cpu", enable_prompt_embeds=True), hf, processor


def hf_vectors(hf: Any, batch: Any) -> list[np.ndarray]:
    """Each input's vectors from transformers, its padding rows (masked to zero) left out."""
    with torch.no_grad():
        out = hf(**batch).embeddings
    mask = batch["attention_mask"].bool()
    return [out[i][mask[i]].numpy() for i in range(out.shape[0])]


def test_prompts_are_the_processors(colqwen2: Any) -> None:
    engine, _, processor = colqwen2
    images = sample_images(SIZES)
    ours = engine.inputs.process([*QUERIES, *images], TextOptions())
    queries = processor.process_queries(QUERIES)
    pages = processor.process_images(images)
    expected = [
        ids[mask.bool()].tolist()
        for batch in (queries, pages)
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)
    ]
    assert [p.token_ids.tolist() for p in ours] == expected
    assert all(p.mrope_positions is None for p in ours)  # plain positions, as transformers


def test_queries_and_pages_in_one_step_equal_transformers(colqwen2: Any) -> None:
    engine, hf, processor = colqwen2
    images = sample_images(SIZES, seed=1)
    # Padded batches on transformers' side (right padding, masked): the valid rows of each.
    expected = hf_vectors(hf, processor.process_queries(QUERIES[:2]))
    expected += hf_vectors(hf, processor.process_images(images))
    expected += hf_vectors(hf, processor.process_queries(QUERIES[2:]))
    inputs: list[Any] = [*QUERIES[:2], *images, QUERIES[2]]
    ours = engine.encode(inputs, task="token_embed")
    assert len(ours) == len(expected)
    for got, want in zip(ours, expected, strict=True):
        assert got.shape == want.shape == (want.shape[0], DIM)
        assert_rel_close(np.asarray(got), want)
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
    # Each alone gives the same vectors (within tolerance: other step shapes).
    for item, got in zip(inputs, ours, strict=True):
        assert_rel_close(np.asarray(engine.encode([item], task="token_embed")[0]), np.asarray(got))


def test_maxsim_scores_equal_score_retrieval(colqwen2: Any) -> None:
    engine, hf, processor = colqwen2
    images = sample_images(SIZES, seed=2)
    queries = [torch.from_numpy(v) for v in hf_vectors(hf, processor.process_queries(QUERIES))]
    pages = [torch.from_numpy(v) for v in hf_vectors(hf, processor.process_images(images))]
    expected = processor.score_retrieval(queries, pages).numpy()  # [queries, pages]
    assert engine.info().score_mode == "late_interaction"
    for i, query in enumerate(QUERIES):
        assert_rel_close(engine.score(query, images), expected[i])
    pairwise = engine.score(QUERIES, images)
    assert_rel_close(pairwise, np.diagonal(expected).copy())
    ranked = engine.rerank(QUERIES[0], images)
    assert [i for i, _ in ranked] == list(np.argsort(-expected[0], kind="stable"))
    assert_rel_close(np.array([s for _, s in ranked]), np.sort(expected[0])[::-1].copy())


def test_precomputed_page_rows_equal_the_image_bit_for_bit(colqwen2: Any) -> None:
    engine, _, _ = colqwen2
    (image,) = sample_images(SIZES[1:2], seed=3)
    (rows,) = engine.image_rows(image)  # the tower's rows of the image alone, and its grid
    page = [{"type": "image_embeds", **rows}]  # a page given by its rows
    (expected,) = engine.encode([image], task="token_embed")
    (got,) = engine.encode([page], task="token_embed")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_refusals_name_the_input(colqwen2: Any) -> None:
    engine, _, _ = colqwen2
    (image,) = sample_images(SIZES[:1])
    with pytest.raises(InputError, match="page image alone or a text query") as info:
        engine.encode(["dog", {"text": "a cat", "image": image}], task="token_embed")
    assert info.value.index == 1
    two = "<|vision_start|><|image_pad|><|vision_end|> and <|image_pad|>"
    with pytest.raises(InputError, match=r"2 image placeholders .* for 1 image") as info:
        engine.encode([{"prompt": two, "image": image}], task="token_embed")
    assert info.value.index == 0
