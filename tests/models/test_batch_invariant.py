"""The batch-invariant mode: every input alone gives, to the bit, what it gives inside shuffled
mixed calls of other inputs (other step sizes too), for each architecture family, in float32
and bfloat16 on the CPU; the normal mode does not (so these tests can fail); and the
invariant products and attention agree with the plain ones within rounding."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

import vecpool
from tests.conftest import tiny_bert_config
from tests.helpers import assert_rel_close, random_prompts, save_hf_model
from tests.models.test_decoders import ARCHS
from tests.models.test_encoders_relative import _deberta_config
from tests.models.test_encoders_rotary import _modernbert_config, _randomize
from vecpool.models.layers import invariant

# Lengths 1 to 3 matter: MKL computes a float32 product of one to three rows with other kernels.
LENGTHS = [1, 2, 3, 5, 9, 17, 30, 45]
CALLS = 5  # shuffled mixed calls per input set


def _qwen3(tmp: Path) -> Path:
    arch = next(a for a in ARCHS if a.name == "qwen3")
    return save_hf_model(arch.hf_model(), tmp)


def _gemma2(tmp: Path) -> Path:  # soft-capped attention logits: the padded attention always
    arch = next(a for a in ARCHS if a.name == "gemma2")
    return save_hf_model(arch.hf_model(), tmp)


def _bert(tmp: Path) -> Path:
    torch.manual_seed(0)
    return save_hf_model(transformers.BertModel(tiny_bert_config()).eval(), tmp)


def _modernbert_classifier(tmp: Path) -> Path:  # rotary, local windows, MEAN classifier head
    cfg = _modernbert_config(classifier_pooling="mean", norm_bias=True)
    hf = _randomize(transformers.ModernBertForSequenceClassification(cfg), seed=1)
    return save_hf_model(hf, tmp)


def _deberta(tmp: Path) -> Path:  # disentangled relative attention: an additive bias
    torch.manual_seed(5)
    return save_hf_model(transformers.DebertaV2Model(_deberta_config("v3")).eval(), tmp)


def _embed(engine: vecpool.Engine, prompts: list[Any]) -> list[np.ndarray]:
    return list(engine.embed(prompts, normalize=True))


def _classify(engine: vecpool.Engine, prompts: list[Any]) -> list[np.ndarray]:
    return [np.asarray(s) for s in engine.classify(prompts)]


def _tokens(engine: vecpool.Engine, prompts: list[Any]) -> list[np.ndarray]:
    return list(engine.encode(prompts, task="token_embed", normalize=False))


# (folder builder, vocabulary, output, engine options)
FAMILIES: dict[str, tuple[Callable[[Path], Path], int, Any, dict[str, Any]]] = {
    "bert-mean": (_bert, 99, _embed, {"pooling": "MEAN"}),
    "bert-cls": (_bert, 99, _embed, {"pooling": "CLS"}),
    "bert-tokens": (_bert, 99, _tokens, {}),
    "modernbert-classifier": (_modernbert_classifier, 99, _classify, {}),
    "deberta-mean": (_deberta, 99, _embed, {"pooling": "MEAN"}),
    "qwen3-last": (_qwen3, 101, _embed, {"pooling": "LAST"}),
    "qwen3-mean": (_qwen3, 101, _embed, {"pooling": "MEAN"}),
    "gemma2-last": (_gemma2, 101, _embed, {"pooling": "LAST"}),
}


def _mismatches(
    folder: Path, vocab: int, run: Any, options: dict[str, Any], dtype: str, invariant_mode: bool
) -> tuple[int, list[np.ndarray]]:
    """Outputs that differ from the input's output alone, over `CALLS` shuffled mixed calls
    (extra inputs of other lengths among them) on an engine with a smaller step budget, so
    the calls also split into other steps (and a decoder's longer prompts into chunks)."""
    prompts = random_prompts(vocab, LENGTHS, seed=3)
    extra = random_prompts(vocab, [4, 11, 23, 40, 60], seed=4)
    common = dict(device="cpu", dtype=dtype, batch_invariant=invariant_mode, **options)
    alone_engine = vecpool.Engine(folder, **common)
    alone = [run(alone_engine, [p])[0] for p in prompts]
    mixed_engine = vecpool.Engine(folder, max_num_batched_tokens=64, **common)
    differ = 0
    for call in range(CALLS):
        gen = random.Random(call)
        batch = [(i, p) for i, p in enumerate(prompts)] + [(-1, p) for p in gen.sample(extra, 3)]
        gen.shuffle(batch)
        engine = mixed_engine if call % 2 else alone_engine
        outs = run(engine, [p for _, p in batch])
        differ += sum(
            not np.array_equal(out, alone[i])
            for (i, _), out in zip(batch, outs, strict=True)
            if i >= 0
        )
    return differ, alone


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    made: dict[Callable[[Path], Path], Path] = {}
    out = {}
    for name, (build, *_rest) in FAMILIES.items():
        if build not in made:
            made[build] = build(tmp_path_factory.mktemp(build.__name__.strip("_")))
        out[name] = made[build]
    return out


NormalRuns = dict[tuple[str, str], tuple[int, list[np.ndarray]]]


@pytest.fixture(scope="module")
def normal_runs() -> NormalRuns:
    """`_mismatches` of a family in the normal mode by (family, dtype), each run once: the
    tests below read the same run."""
    return {}


def _normal(runs: NormalRuns, folders: dict[str, Path], family: str, dtype: str) -> Any:
    if (family, dtype) not in runs:
        _, vocab, run, options = FAMILIES[family]
        runs[family, dtype] = _mismatches(folders[family], vocab, run, options, dtype, False)
    return runs[family, dtype]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_input_alone_equals_it_in_mixed_calls(
    family: str, dtype: str, folders: dict[str, Path], normal_runs: NormalRuns
) -> None:
    _, vocab, run, options = FAMILIES[family]
    differ, alone = _mismatches(folders[family], vocab, run, options, dtype, invariant_mode=True)
    assert differ == 0, f"{differ} outputs of {CALLS * len(LENGTHS)} differ from the input alone"
    # The invariant mode computes the same function as the normal one, within rounding (its
    # attention sums in float32 in another order; bfloat16 rounds every layer's output).
    _, plain = _normal(normal_runs, folders, family, dtype)
    for ours, theirs in zip(alone, plain, strict=True):
        assert_rel_close(ours, theirs, rtol=1e-5 if dtype == "float32" else 5e-2)


# The normal mode is not batch-invariant (which is why the mode exists): shown on each family
# in float32, where MKL's products of one to three rows differ from larger ones.
@pytest.mark.parametrize("family", ["bert-mean", "deberta-mean", "qwen3-last", "gemma2-last"])
def test_normal_mode_is_not_invariant(
    family: str, folders: dict[str, Path], normal_runs: NormalRuns
) -> None:
    differ, _ = _normal(normal_runs, folders, family, "float32")
    assert differ > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_linear_rows_do_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    w, b = torch.randn(96, 80, dtype=dtype), torch.randn(96, dtype=dtype)
    rows = torch.randn(300, 80, dtype=dtype)
    full = invariant.invariant_linear(rows, w, b)
    assert_rel_close(
        full.float().numpy(),
        F.linear(rows.float(), w.float(), b.float()).numpy(),
        rtol=1e-5 if dtype == torch.float32 else 2e-2,
    )
    for m in (1, 2, 3, 4, 63, 64, 65, 200):  # every M, every position in a tile
        for offset in (0, 1, 31, 63):
            x = torch.cat([torch.randn(offset, 80, dtype=dtype), rows[:m]])
            got = invariant.invariant_linear(x, w, b)[offset:]
            assert torch.equal(got, full[:m]), (m, offset)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_padded_attention_rows_do_not_depend_on_padding(
    dtype: torch.dtype, softcap: float | None
) -> None:
    torch.manual_seed(0)
    n, heads, dim = 9, 2, 8
    q, k, v = (torch.randn(1, heads, n, dim, dtype=dtype) for _ in range(3))
    bias = torch.randn(1, heads, n, n)
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    alone = invariant.padded_attention(q, k, v, causal, scale=0.4, softcap=softcap, bias=bias)
    # Reference: the plain softmax attention in float64.
    s = (q.double() @ k.double().transpose(-1, -2)) * 0.4
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = (s + bias.double()).masked_fill(~causal, float("-inf"))
    ref = torch.softmax(s, dim=-1) @ v.double()
    assert_rel_close(
        alone.double().numpy(), ref.numpy(), rtol=1e-6 if dtype == torch.float32 else 1e-2
    )
    for length in (10, 64, 65, 130):  # the step's longest sequence: other padding, other blocks
        pad = length - n
        qp, kp, vp = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        mask = F.pad(causal, (0, pad, 0, pad))
        out = invariant.padded_attention(
            qp, kp, vp, mask, scale=0.4, softcap=softcap, bias=F.pad(bias, (0, pad, 0, pad))
        )
        assert torch.equal(out[:, :, :n], alone), length


def test_real_minilm_on_two_threads(default_model_dir: Path) -> None:
    """A real-size model, whose steps are large enough that torch splits elementwise work and
    products between threads (the tiny models above run on one): texts alone and mixed."""
    words = "the quick brown fox jumps over a lazy dog while seven wizards box".split()
    gen = random.Random(0)
    texts = [" ".join(gen.choices(words, k=n)) for n in (1, 2, 3, 7, 30, 90, 200, 15, 60, 120)]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = vecpool.Engine(device="cpu", batch_invariant=True)
        alone = [engine.embed([t])[0] for t in texts]
        for call in range(3):
            order = list(range(len(texts)))
            gen.shuffle(order)
            mixed = engine.embed([texts[i] for i in order])
            assert all(np.array_equal(mixed[j], alone[i]) for j, i in enumerate(order)), call
    finally:  # the suite's thread count for the tests after this one
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fn", [F.gelu, F.silu, torch.tanh, torch.exp, torch.cos])
def test_piecewise_elements_do_not_depend_on_the_tensor(fn: Any) -> None:
    torch.manual_seed(0)
    x = torch.randn(100_003)
    full = invariant.piecewise(fn, x)
    assert_rel_close(full.numpy(), fn(x.double()).float().numpy(), rtol=1e-6)
    for lo, hi in ((0, 1), (5, 37), (17, 70_001), (99_000, 100_003)):
        assert torch.equal(invariant.piecewise(fn, x[lo:hi]), full[lo:hi]), (lo, hi)


def test_flag_reaches_engine_args() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    vecpool.EngineArgs.add_cli_args(parser)
    assert vecpool.EngineArgs.from_cli_args(
        parser.parse_args(["--batch-invariant"])
    ).batch_invariant
    assert not vecpool.EngineArgs.from_cli_args(parser.parse_args([])).batch_invariant


def test_row_norm_independent_of_the_other_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The heads' normalization under the mode: each row's L2 norm is the same bits whatever
    rows share the call, and within float32 rounding of `Tensor.norm`."""
    x = torch.randn(200, 96, generator=torch.Generator().manual_seed(3))
    calls: list[int] = []

    def counted(rows: torch.Tensor, *, keepdim: bool = False) -> torch.Tensor:
        calls.append(rows.shape[0])
        return row_l2_norm(rows, keepdim=keepdim)

    row_l2_norm = invariant.row_l2_norm
    monkeypatch.setattr(invariant, "row_l2_norm", counted)
    with invariant.InvariantFunctions():
        full = x.norm(dim=1, keepdim=True)
        parts = [x[i : i + n].norm(dim=1, keepdim=True) for i, n in ((0, 1), (5, 3), (60, 77))]
    assert calls == [200, 1, 3, 77]  # the mode routes the heads' norms through row_l2_norm
    for (i, n), part in zip(((0, 1), (5, 3), (60, 77)), parts, strict=True):
        assert torch.equal(part, full[i : i + n])
    assert_rel_close(full.numpy(), x.double().norm(dim=1, keepdim=True).float().numpy(), 1e-6)
