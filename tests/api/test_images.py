"""Images through the Python API: every input form an image takes, mixed with texts in one
call, equal to transformers' `get_image_features` / `get_image_features` on the same weights and
the folder's own image processor; score and rerank of texts against images; what is refused,
alone.

Tolerance: 1e-5 of the largest output (`assert_rel_close`), fp32 on the CPU: the towers compute
transformers' arithmetic in other kernel shapes (flat batches, a matrix product for the patch
convolution).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import vecpool
from tests.helpers import assert_rel_close, pipeline_chunks
from tests.image_models import (
    CLIP,
    SIGLIP,
    encoded,
    hf_image_features,
    hf_text_features,
    sample_images,
    save_tiny_dual_encoder,
)
from vecpool.errors import ConfigError, InputError

TEXTS = ["a photo of a cat", "two red cars on the sea", "bird"]


@pytest.fixture(scope="module", params=[CLIP, SIGLIP], ids=["clip", "siglip"])
def dual(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp(request.param.name) / "model"
    hf = save_tiny_dual_encoder(path, request.param)
    engine = vecpool.Engine(path, device="cpu", normalize=False, allowed_local_media_path=path)
    return engine, hf, path


def test_texts_and_images_mixed_equal_transformers(dual: Any) -> None:
    engine, hf, path = dual
    images = sample_images(3)
    out = engine.embed([TEXTS[0], images[0], TEXTS[1], images[1], images[2], TEXTS[2]])
    assert out.shape == (6, engine.info().output_dim)
    assert_rel_close(out[[0, 2, 5]], hf_text_features(hf, path, TEXTS))
    assert_rel_close(out[[1, 3, 4]], hf_image_features(hf, path, images))
    # A text-only call runs the text tower alone and gives the same rows.
    assert_rel_close(engine.embed(TEXTS), out[[0, 2, 5]])


def test_a_large_call_of_images_runs_in_chunks_of_fewer_inputs(
    dual: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An image counts as `PIPELINE_IMAGE_WEIGHT` texts in a chunk's size: a call of images is
    prepared (read) a few images at a time while the device runs the ones before; texts keep
    their chunks. The chunks' results are those of one call (same rows in another batching,
    the tolerance of the module)."""
    engine, _, _ = dual
    images = sample_images(3)
    items = [TEXTS[i % 3] if i % 4 == 3 else images[i % 3] for i in range(10)]
    whole = engine.embed(items)
    monkeypatch.setattr(vecpool.api.engine, "PIPELINE_IMAGE_WEIGHT", 2)
    sizes = pipeline_chunks(monkeypatch, first=4, chunk=8)
    assert_rel_close(engine.embed(items), whole)
    # weights 2 2 | 2 1 2 2 | 2 1 2 2: a first chunk of weight <= 4, then <= 8
    assert sizes == [2, 4, 4]
    sizes.clear()
    engine.embed([*TEXTS, *TEXTS, *TEXTS])  # nine texts: by count, as in a text model
    assert sizes == [4, 5]


def test_every_image_form_gives_the_same_vector(dual: Any) -> None:
    engine, hf, path = dual
    (image,) = sample_images(1)
    png = encoded(image, "PNG")
    (path / "picture.png").write_bytes(png)
    forms = [
        image,
        png,
        bytearray(png),
        memoryview(png),
        path / "picture.png",
        "data:image/png;base64," + base64.b64encode(png).decode(),
        {"image": image},
        {"image": str(path / "picture.png")},
        {"image": base64.b64encode(png).decode()},
    ]
    out = engine.embed(forms)
    expected = hf_image_features(hf, path, [image])
    # The same pixels whatever the form (a row's result may still depend on its place in the
    # step's products: within tolerance, not to the bit).
    assert_rel_close(out, np.repeat(expected, len(forms), axis=0))
    # A single image is one input (alone, its products have other shapes: within tolerance).
    assert_rel_close(engine.embed(image), out[:1])


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP", "GIF", "BMP", "TIFF"])
def test_encoded_formats(dual: Any, fmt: str) -> None:
    engine, hf, path = dual
    (image,) = sample_images(1, seed=3)
    data = encoded(image, fmt)
    import io

    from PIL import Image

    decoded = Image.open(io.BytesIO(data))
    decoded.seek(0)
    assert_rel_close(engine.embed([data]), hf_image_features(hf, path, [decoded.convert("RGB")]))


def test_bad_images_fail_alone_naming_the_input(dual: Any) -> None:
    engine, _, path = dual
    (image,) = sample_images(1)
    cases = [
        (b"", "empty"),
        (b"definitely not an image", "not an image"),
        (encoded(image, "PNG")[:60], "truncated|corrupt|not an image|cannot"),
        (b"<svg xmlns='http://www.w3.org/2000/svg'></svg>", "SVG|svg|not an image"),
        ({"image": "/etc/hostname"}, "outside|refused|allowed"),
        ({"image": str(path / ".." / ".." / "x.png")}, "outside|refused|allowed|escape"),
        ({"image": "http://example.com/x.png"}, "allowed-media-domains"),
    ]
    for bad, reason in cases:
        with pytest.raises(InputError, match=rf"input 1.*({reason})") as info:
            engine.embed(["a photo of a cat", bad])
        assert info.value.index == 1
    # The engine is untouched: the next call is served.
    assert engine.embed(["a photo of a cat", image]).shape[0] == 2


def test_score_and_rerank_texts_against_images(dual: Any) -> None:
    engine, hf, path = dual
    images = sample_images(3)
    text = hf_text_features(hf, path, TEXTS[:1])[0]
    pictures = hf_image_features(hf, path, images)
    cosine = pictures @ text / (np.linalg.norm(pictures, axis=1) * np.linalg.norm(text))
    scores = engine.score(TEXTS[0], images)
    np.testing.assert_allclose(scores, cosine, atol=1e-5)
    ranked = engine.rerank(TEXTS[0], images)
    assert [i for i, _ in ranked] == list(np.argsort(-cosine))


def test_tasks_that_take_no_image_refuse_it_alone(dual: Any) -> None:
    engine, _, _ = dual
    (image,) = sample_images(1)
    with pytest.raises(InputError, match="does not take images"):
        engine.encode([image], task="token_embed")


def test_a_text_model_refuses_an_image_alone(minilm: vecpool.Engine) -> None:
    (image,) = sample_images(1)
    with pytest.raises(InputError, match=r"input 1: an image, but this model has no image tower"):
        minilm.embed(["text", image])
    assert minilm.embed(["text"]).shape[0] == 1


def test_sentence_transformers_clip_folder(tmp_path: Path) -> None:
    """sentence-transformers' CLIP layout: the model in 0_CLIPModel/, no pooling or Normalize
    module (its vectors are get_*_features, unnormalized)."""
    inner = tmp_path / "st" / "0_CLIPModel"
    hf = save_tiny_dual_encoder(inner, CLIP, seed=5)
    modules = [
        {
            "idx": 0,
            "name": "0",
            "path": "0_CLIPModel",
            "type": "sentence_transformers.models.CLIPModel",
        }
    ]
    (tmp_path / "st" / "modules.json").write_text(json.dumps(modules))
    # sentence-transformers reads the tokenizer through transformers' fast tokenizer class.
    (inner / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>"})
    )
    engine = vecpool.Engine(tmp_path / "st", device="cpu")
    images = sample_images(2)
    out = engine.embed([TEXTS[1], *images])
    assert engine.info().embed_normalize is False
    assert_rel_close(out[:1], hf_text_features(hf, inner, TEXTS[1:2]))
    assert_rel_close(out[1:], hf_image_features(hf, inner, images))
    # And sentence-transformers itself on the folder (one call per modality, as it requires).
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(tmp_path / "st"), device="cpu")
    assert_rel_close(out[:1], st.encode(TEXTS[1:2]))
    assert_rel_close(out[1:], st.encode(images))


def test_a_processor_that_does_not_match_the_model_is_refused_at_start(tmp_path: Path) -> None:
    path = tmp_path / "clip"
    save_tiny_dual_encoder(path, CLIP)
    config = json.loads((path / "preprocessor_config.json").read_text())
    config["crop_size"] = {"height": 48, "width": 48}  # 6x6 patches; the tower takes 4x4
    (path / "preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(
        ConfigError, match=r"makes 6x6 patches of 192 values, but CLIPModel takes 4x4"
    ):
        vecpool.Engine(path, device="cpu")
