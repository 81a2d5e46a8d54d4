"""ColPali (`ColPaliForRetrieval`: PaliGemma, then a projection) against transformers on the
same random weights, folder and pixel values: the processor's prompts (a page's image tokens,
BOS and prompt; a query's BOS, prefix and augmentation tokens) token for token, SigLIP's pixel
values, every token's L2-normalised vector for text queries and page images in one step
(PaliGemma's bidirectional prefix, its positions from 1), and MaxSim scores equal to
`ColPaliProcessor.score_retrieval`.

Tolerance: 1e-5 of the largest value (`assert_rel_close`), fp32 on the CPU: the same arithmetic
in other kernel shapes (a flat batch, the patch convolution as one matrix product). Token ids
and pixel values are compared exactly: the same tokenizer on the same text, the same float
operations on the same 8-bit values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

import vecpool
from tests.helpers import assert_rel_close
from tests.models.test_colqwen2 import randomize, retrieval_tokenizer, sample_images
from vecpool.errors import InputError
from vecpool.inputs.image_processing import load_image_processor
from vecpool.inputs.prompts import TextOptions

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<image>"]
WORDS = "\n Question : Describe the image . a cat dog red house on where is".split(" ")
IMAGE_TOKEN = SPECIALS.index("<image>")
SIDE, PATCH, DIM = 16, 4, 16  # 16x16 pixels: 4x4 patches, 16 image tokens
QUERIES = ["where is the cat", "a red house", "dog"]
SIZES = [(40, 27), (21, 50), (16, 16)]


def save_tiny_colpali(path: Path) -> tuple[Any, Any]:
    """A tiny ColPali folder at `path` (weights, processor, tokenizer); transformers' model
    (fp32, eager attention) and processor read back from it."""
    text = dict(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=512,
    )
    vision = dict(
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=SIDE,
        patch_size=PATCH,
    )
    vlm = transformers.PaliGemmaConfig(
        text_config=text,
        vision_config=vision,
        image_token_index=IMAGE_TOKEN,
        vocab_size=40,
        projection_dim=32,
        hidden_size=32,
    )
    model = transformers.ColPaliForRetrieval(
        transformers.ColPaliConfig(vlm_config=vlm, embedding_dim=DIM)
    )
    randomize(model, seed=0)
    model.save_pretrained(str(path))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=retrieval_tokenizer(SPECIALS, WORDS),
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
    )
    images: Any = transformers.SiglipImageProcessorPil(size={"height": SIDE, "width": SIDE})
    images.image_seq_length = (SIDE // PATCH) ** 2
    transformers.ColPaliProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(
        str(path)
    )
    hf = transformers.ColPaliForRetrieval.from_pretrained(str(path), attn_implementation="eager")
    return hf.eval(), transformers.ColPaliProcessor.from_pretrained(str(path))


@pytest.fixture(scope="module")
def colpali(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("colpali") / "model"
    hf, processor = save_tiny_colpali(path)
    return vecpool.Engine(path, device="cpu", enable_prompt_embeds=True), hf, processor, path


def hf_vectors(hf: Any, batch: Any) -> list[np.ndarray]:
    """Each input's vectors from transformers, called as its documentation calls it (the
    processor's whole output, `token_type_ids` among it), padding rows left out."""
    with torch.no_grad():
        out = hf(**batch).embeddings
    mask = batch["attention_mask"].bool()
    return [out[i][mask[i]].numpy() for i in range(out.shape[0])]


def test_prompts_and_pixels_are_the_processors(colpali: Any) -> None:
    engine, _, processor, path = colpali
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
    tokens = (SIDE // PATCH) ** 2
    assert expected[-1][: tokens + 1] == [IMAGE_TOKEN] * tokens + [SPECIALS.index("<bos>")]
    ours_pixels = load_image_processor(path)
    assert ours_pixels is not None
    side = SIDE // PATCH
    for image, theirs in zip(images, pages["pixel_values"].numpy(), strict=True):
        # [3, H, W] -> rows of patches, each laid out (channel, y, x)
        rows = theirs.reshape(3, side, PATCH, side, PATCH).transpose(1, 3, 0, 2, 4)
        np.testing.assert_array_equal(ours_pixels(image).patches, rows.reshape(side * side, -1))


def test_queries_and_pages_in_one_step_equal_transformers(colpali: Any) -> None:
    engine, hf, processor, _ = colpali
    images = sample_images(SIZES, seed=1)
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
    for item, got in zip(inputs[1:4], ours[1:4], strict=True):  # alone: the same vectors
        assert_rel_close(np.asarray(engine.encode([item], task="token_embed")[0]), np.asarray(got))


def test_maxsim_scores_equal_score_retrieval(colpali: Any) -> None:
    engine, hf, processor, _ = colpali
    images = sample_images(SIZES, seed=2)
    queries = [torch.from_numpy(v) for v in hf_vectors(hf, processor.process_queries(QUERIES))]
    pages = [torch.from_numpy(v) for v in hf_vectors(hf, processor.process_images(images))]
    expected = processor.score_retrieval(queries, pages).numpy()  # [queries, pages]
    assert engine.info().score_mode == "late_interaction"
    for i, query in enumerate(QUERIES):
        assert_rel_close(engine.score(query, images), expected[i])
    ranked = engine.rerank(QUERIES[1], images)
    assert [i for i, _ in ranked] == list(np.argsort(-expected[1], kind="stable"))


def test_precomputed_page_rows_equal_the_image_bit_for_bit(colpali: Any) -> None:
    engine, _, _, _ = colpali
    (image,) = sample_images(SIZES[1:2], seed=3)
    (rows,) = engine.image_rows(image)  # the tower's rows of the image alone, and its grid
    page = [{"type": "image_embeds", **rows}]  # a page given by its rows
    (expected,) = engine.encode([image], task="token_embed")
    (got,) = engine.encode([page], task="token_embed")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_refusals_name_the_input(colpali: Any) -> None:
    engine, _, _, _ = colpali
    (image,) = sample_images(SIZES[:1])
    with pytest.raises(InputError, match="page image alone or a text query") as info:
        engine.encode(["dog", [{"type": "text", "text": "a"}, {"type": "image", "image": image}]])
    assert info.value.index == 1
    with pytest.raises(InputError, match=r"image 0's placeholder is 3 tokens long") as info:
        engine.encode([{"prompt": "<image><image><image><bos>dog", "image": image}])
    assert info.value.index == 0
