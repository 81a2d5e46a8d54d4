"""Chunked prefill on the decoders: a prompt longer than the token budget runs in chunks over
several steps, each chunk attending to the keys and values its earlier chunks left, and pools
to what the same prompt gives run whole.

Tolerance: 1e-5 of the reference's largest magnitude (fp32). A chunk's attention runs over a
different padded block than the whole prompt's and MEAN sums each chunk before adding the
chunks, so results differ from the whole run by float32 rounding only (measured: at most
1.3e-6 of the magnitude); a wrong key, position, mask or window moves them by 1e-2 or more.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

import vecpool
from tests.helpers import assert_rel_close, random_prompts, save_hf_model
from tests.models.test_decoders import ARCH_IDS, ARCHS, VOCAB, Arch

LONG = 90  # tokens of the long prompt: past every sliding window of the configs
BUDGETS = [4, 16, 40]  # 23, 6 and 3 chunks; 4 is shorter than the windows (5 and 6)


@pytest.fixture(scope="module", params=ARCHS, ids=ARCH_IDS)
def arch_folder(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Arch, Path]:
    arch: Arch = request.param
    return arch, save_hf_model(arch.hf_model(), tmp_path_factory.mktemp(f"chunked_{arch.name}"))


@pytest.fixture(scope="module")
def whole(arch_folder: tuple[Arch, Path]) -> tuple[vecpool.Engine, vecpool.Engine]:
    """The architecture's engines that run every prompt whole (LAST, MEAN): the reference of
    the module's tests, which only read from them."""
    _, folder = arch_folder
    return vecpool.Engine(folder, device="cpu"), vecpool.Engine(
        folder, device="cpu", pooling="MEAN"
    )


@pytest.fixture(scope="module")
def long_prompt_whole(whole: tuple[vecpool.Engine, vecpool.Engine]) -> dict[str, Any]:
    """What the whole run gives the long prompt of `test_chunked_prompt_matches_whole`."""
    return _outputs(*whole, random_prompts(VOCAB, [LONG], seed=21))


def _outputs(engine: vecpool.Engine, mean: vecpool.Engine, inputs: list[Any]) -> dict[str, Any]:
    """LAST (the decoders' default), MEAN and ALL (per-token hidden states) of `inputs`."""
    return {
        "LAST": engine.embed(inputs, normalize=False),
        "MEAN": mean.embed(inputs, normalize=False),
        "ALL": engine.encode(inputs, task="token_embed", normalize=False),
    }


def _assert_outputs_close(got: dict[str, Any], want: dict[str, Any]) -> None:
    for key in ("LAST", "MEAN"):
        for a, b in zip(got[key], want[key], strict=True):
            assert_rel_close(a, b, rtol=1e-5)
    for a, b in zip(got["ALL"], want["ALL"], strict=True):
        assert_rel_close(a, b, rtol=1e-5)


@pytest.mark.parametrize("budget", BUDGETS)
def test_chunked_prompt_matches_whole(
    arch_folder: tuple[Arch, Path], long_prompt_whole: dict[str, Any], budget: int
) -> None:
    _, folder = arch_folder
    chunked = vecpool.Engine(folder, device="cpu", max_num_batched_tokens=budget)
    chunked_mean = vecpool.Engine(
        folder, device="cpu", max_num_batched_tokens=budget, pooling="MEAN"
    )
    prompt = random_prompts(VOCAB, [LONG], seed=21)[0]
    want = long_prompt_whole
    before = chunked.core.num_steps
    got = _outputs(chunked, chunked_mean, [prompt])
    # Each of the three calls ran the prompt in ceil(90 / budget) steps.
    assert chunked.core.num_steps - before == 2 * math.ceil(LONG / budget)
    _assert_outputs_close(got, want)
    # Given as prompt embeds, the same chunks give exactly what the ids give.
    embeds = {"prompt_embeds": chunked.embed_tokens(prompt)}
    as_embeds = _outputs(chunked, chunked_mean, [embeds])
    for key in ("LAST", "MEAN"):
        assert np.array_equal(as_embeds[key], got[key])
    assert np.array_equal(as_embeds["ALL"][0], got["ALL"][0])
    assert chunked.model_runner.kv_cache is not None
    assert chunked.model_runner.kv_cache.num_entries == 0


def test_chunks_share_steps_with_other_requests(
    arch_folder: tuple[Arch, Path],
    whole: tuple[vecpool.Engine, vecpool.Engine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two long prompts (one as prompt embeds) and short ones in one call, budget 16: steps
    hold a chunk next to other requests, and every output is what the whole run gives."""
    _, folder = arch_folder
    chunked = vecpool.Engine(folder, device="cpu", max_num_batched_tokens=16)
    chunked_mean = vecpool.Engine(folder, device="cpu", max_num_batched_tokens=16, pooling="MEAN")
    prompts: list[Any] = random_prompts(VOCAB, [LONG, 5, 12, 3, 60, 9, 2], seed=22)
    prompts[4] = {"prompt_embeds": chunked.embed_tokens(prompts[4])}
    steps: list[list[tuple[int, int]]] = []
    original = chunked.model_runner.prepare

    def record(step: Any) -> Any:
        steps.append([(c.start, c.num_tokens) for c in step.chunks])
        return original(step)

    monkeypatch.setattr(chunked.model_runner, "prepare", record)
    got = _outputs(chunked, chunked_mean, prompts)
    _assert_outputs_close(got, _outputs(*whole, prompts))
    # Some step ran a later chunk of a long prompt (start > 0) next to a whole short prompt.
    assert any(
        any(start > 0 for start, _ in step) and any(start == 0 and n < 16 for start, n in step)
        for step in steps
    )
    assert all(sum(n for _, n in step) <= 16 for step in steps)


@pytest.mark.parametrize("pooling", ["CLS", "MAX", "MEAN_SQRT_LEN", "WEIGHTED_MEAN"])
def test_every_sequence_method_accumulates_across_chunks(tmp_path: Path, pooling: str) -> None:
    arch = next(a for a in ARCHS if a.name == "qwen3")
    folder = save_hf_model(arch.hf_model(), tmp_path)
    prompts = random_prompts(VOCAB, [LONG, 7, 33], seed=23)
    whole = vecpool.Engine(folder, device="cpu", pooling=pooling).embed(prompts, normalize=False)
    chunked = vecpool.Engine(folder, device="cpu", pooling=pooling, max_num_batched_tokens=8)
    for a, b in zip(chunked.embed(prompts, normalize=False), whole, strict=True):
        assert_rel_close(a, b, rtol=1e-5)


def test_step_classify_and_token_classify_across_chunks(tmp_path: Path) -> None:
    """STEP rows (token_embed with step_tag_id), a sequence classifier's LAST row and a token
    classifier's rows, chunked as whole."""
    arch = next(a for a in ARCHS if a.name == "qwen3")
    prompts = random_prompts(VOCAB, [LONG, 20], seed=24)
    tag = prompts[0][50]  # present in the long prompt's later chunks
    engines = {}
    for name, cls in [
        ("base", transformers.Qwen3Model),
        ("seq", transformers.Qwen3ForSequenceClassification),
        ("tok", transformers.Qwen3ForTokenClassification),
    ]:
        torch.manual_seed(0)
        hf = cls(arch.hf_config(num_labels=3)).eval()
        folder = save_hf_model(hf, tmp_path / name)
        engines[name] = (
            vecpool.Engine(folder, device="cpu"),
            vecpool.Engine(folder, device="cpu", max_num_batched_tokens=12),
        )
    whole, chunked = engines["base"]
    steps_whole = whole.encode(prompts, task="token_embed", step_tag_id=tag)
    steps_chunked = chunked.encode(prompts, task="token_embed", step_tag_id=tag)
    assert steps_whole[0].shape[0] == prompts[0].count(tag) >= 1
    for a, b in zip(steps_chunked, steps_whole, strict=True):
        assert a.shape == b.shape
        if a.size:
            assert_rel_close(a, b, rtol=1e-5)
    whole, chunked = engines["seq"]
    assert_rel_close(chunked.classify(prompts), whole.classify(prompts), rtol=1e-5)
    whole, chunked = engines["tok"]
    got = chunked.encode(prompts, task="token_classify")
    for a, b in zip(got, whole.encode(prompts, task="token_classify"), strict=True):
        assert_rel_close(a, b, rtol=1e-5)
