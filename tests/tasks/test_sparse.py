"""SPLADE sparse vectors from the masked-LM head: against sentence-transformers' `SparseEncoder`
(a saved `MLMTransformer` + `SpladePooling` folder) and against a direct computation from
transformers' `BertForMaskedLM` logits."""

from __future__ import annotations

import base64
import io
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sentence_transformers import SparseEncoder
from starlette.testclient import TestClient

import vecpool
from tests.helpers import assert_rel_close
from vecpool.models.loading.folder import ModelFolder, SpladeSpec
from vecpool.pooling.heads import HeadBatch, SparseHead
from vecpool.pooling.methods import PoolingMetadata
from vecpool.server.app import create_app
from vecpool.server.config import ServerConfig

try:  # newer sentence-transformers; older ones have them in `sparse_encoder.models`
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling
except ImportError:
    from sentence_transformers.sparse_encoder.models import (  # type: ignore[no-redef]
        MLMTransformer,
        SpladePooling,
    )

TEXTS = ["cats eat fish and meat", "the stock market fell", "a b c d e f g h i j k l m n o p"]
SPECIAL_TOKENS = ("[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]")


def _special_ids(engine: vecpool.Engine) -> set[int]:
    return {engine.tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}


def _reference(hf: Any, ids: list[int], exclude: set[int]) -> np.ndarray:
    """`[vocab]`: max over the positions whose id is not in `exclude` of log(1 + relu(logits))."""
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ids])).logits[0]
    keep = torch.tensor([i not in exclude for i in ids])
    weights = torch.log(1 + torch.relu(logits[keep]))
    return weights.max(dim=0).values.numpy()


# ---- equal to sentence-transformers' SparseEncoder --------------------------------------


@pytest.fixture(
    scope="module",
    params=[("max", "relu"), ("sum", "relu"), ("max", "log1p_relu"), ("sum", "log1p_relu")],
    ids="-".join,
)
def st_sparse(
    request: pytest.FixtureRequest,
    splade: tuple[Path, Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, SparseEncoder]:
    """(folder, the SparseEncoder read back from it): the tiny BertForMaskedLM with
    SpladePooling(strategy, activation), saved by sentence-transformers itself."""
    strategy, activation = request.param
    modules = [MLMTransformer(str(splade[0])), SpladePooling(strategy, activation)]
    folder = tmp_path_factory.mktemp(f"st_sparse_{strategy}_{activation}")
    SparseEncoder(modules=modules, device="cpu").save(str(folder))
    return folder, SparseEncoder(str(folder), device="cpu")


def test_sparse_equals_sentence_transformers(st_sparse: tuple[Path, SparseEncoder]) -> None:
    folder, st = st_sparse
    pooling = json.loads((folder / "1_SpladePooling" / "config.json").read_text())
    spec = ModelFolder.load(folder).splade
    assert spec == SpladeSpec(pooling["pooling_strategy"], pooling["activation_function"])
    expected = st.encode(TEXTS, convert_to_tensor=True, convert_to_sparse_tensor=False).numpy()
    engine = vecpool.Engine(folder, device="cpu")
    got = np.stack(engine.encode(TEXTS, task="sparse"))  # one batch
    assert got.shape == expected.shape == (3, engine.model.vocab_size)
    for row, reference in zip(got, expected, strict=True):
        assert_rel_close(row, reference, rtol=1e-5)
    # embed_sparse: the nonzero weights of the same vectors, heaviest first.
    for vector, row in zip(engine.embed_sparse(TEXTS), got, strict=True):
        assert sorted(vector) == np.flatnonzero(row > 0).tolist()
        assert list(vector.values()) == sorted(vector.values(), reverse=True)
        assert all(vector[i] == pytest.approx(float(row[i])) for i in vector)
    # sentence-transformers pools the special tokens too: leaving them out differs.
    excluded = np.stack(engine.encode(TEXTS, task="sparse", exclude_special_tokens=True))
    assert np.abs(excluded - expected).max() > 1e-2 * np.abs(expected).max()


def test_splade_pooling_fields_that_change_nothing_are_accepted(
    st_sparse: tuple[Path, SparseEncoder], tmp_path: Path
) -> None:
    """`chunk_size` bounds memory; `embedding_dimension` (its older name
    `word_embedding_dimension`) is the vocabulary size."""
    folder = Path(shutil.copytree(st_sparse[0], tmp_path / "model"))
    config = folder / "1_SpladePooling" / "config.json"
    fields = json.loads(config.read_text())
    del fields["embedding_dimension"]
    fields |= {"word_embedding_dimension": 30522, "chunk_size": 2}
    config.write_text(json.dumps(fields))
    expected = ModelFolder.load(st_sparse[0]).splade
    assert expected is not None and ModelFolder.load(folder).splade == expected


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"pooling_strategy": "mean"}, "pooling_strategy 'mean' is not supported"),
        ({"activation_function": "gelu"}, "activation_function 'gelu' is not supported"),
        ({"temperature": 0.5}, r"SpladePooling field\(s\) \['temperature'\] are not supported"),
    ],
)
def test_splade_pooling_fields_that_would_change_the_math_are_refused(
    splade: tuple[Path, Any], tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    modules = [MLMTransformer(str(splade[0])), SpladePooling("max", "relu")]
    SparseEncoder(modules=modules, device="cpu").save(str(tmp_path))
    config = tmp_path / "1_SpladePooling" / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | change))
    with pytest.raises(vecpool.ModelLoadError, match=message):
        vecpool.Engine(tmp_path, device="cpu")


def test_max_active_dims_is_refused(splade: tuple[Path, Any], tmp_path: Path) -> None:
    modules = [MLMTransformer(str(splade[0])), SpladePooling("max", "relu")]
    SparseEncoder(modules=modules, device="cpu", max_active_dims=8).save(str(tmp_path))
    with pytest.raises(vecpool.ModelLoadError, match="max_active_dims"):
        vecpool.Engine(tmp_path, device="cpu")


def test_splade_pooling_needs_a_masked_lm_head(tiny_bert: tuple[Path, Any], tmp_path: Path) -> None:
    folder = Path(shutil.copytree(tiny_bert[0], tmp_path / "model"))
    (folder / "1_SpladePooling").mkdir()
    (folder / "1_SpladePooling" / "config.json").write_text('{"pooling_strategy": "max"}')
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_SpladePooling", "type": "x.SpladePooling"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(
        vecpool.ModelLoadError, match=r"SpladePooling .* BertModel has no masked-LM"
    ):
        vecpool.Engine(folder, device="cpu")


# ---- a plain *ForMaskedLM folder --------------------------------------------------------


def test_plain_masked_lm_pools_every_token_by_default(
    splade: tuple[Path, Any], splade_engine: vecpool.Engine
) -> None:
    """No SpladePooling module: sentence-transformers' defaults, max of log(1 + relu)."""
    engine = splade_engine
    assert ModelFolder.load(splade[0]).splade is None
    dense = engine.encode(TEXTS, task="sparse")  # [vocab] per input, one batch
    for text, row in zip(TEXTS, dense, strict=True):
        ids = engine.tokenize(text)
        assert row.shape == (engine.model.vocab_size,)
        assert_rel_close(row, _reference(splade[1], ids, exclude=set()))
    # The same as sentence-transformers' reading of this folder (it adds SpladePooling()).
    st = SparseEncoder(str(splade[0]), device="cpu")
    expected = st.encode(TEXTS, convert_to_tensor=True, convert_to_sparse_tensor=False).numpy()
    for row, reference in zip(dense, expected, strict=True):
        assert_rel_close(row, reference)


def test_exclude_special_tokens(splade: tuple[Path, Any], splade_engine: vecpool.Engine) -> None:
    engine = splade_engine
    special = _special_ids(engine)
    params = vecpool.PoolingParams(task="sparse", exclude_special_tokens=True)
    assert vecpool.TASKS["sparse"].needs_token_ids(params)
    dense = engine.encode(TEXTS, task="sparse", exclude_special_tokens=True)
    every = engine.encode(TEXTS, task="sparse")
    for text, row, full in zip(TEXTS, dense, every, strict=True):
        ids = engine.tokenize(text)
        assert ids[0] in special and ids[-1] in special
        assert_rel_close(row, _reference(splade[1], ids, exclude=special))
        assert np.abs(row - full).max() > 1e-2 * np.abs(full).max()  # the specials mattered
    (vector,) = engine.embed_sparse(TEXTS[:1], exclude_special_tokens=True)
    assert sorted(vector) == np.flatnonzero(dense[0] > 0).tolist()
    # One engine step mixing both settings gives each request what it gets alone.
    requests = [
        *engine.make_requests(TEXTS[:2], params),
        *engine.make_requests(TEXTS[2:], vecpool.PoolingParams(task="sparse")),
    ]
    steps = engine.core.num_steps
    for request in requests:
        engine.core.add_requests([request])
    engine.core.run_until_done(requests)
    assert engine.core.num_steps == steps + 1
    for request, alone in zip(requests, [dense[0], dense[1], every[2]], strict=True):
        assert request.error is None and request.output is not None
        assert np.abs(request.output - alone).max() <= 1e-6


def test_exclude_special_tokens_is_checked(splade_engine: vecpool.Engine) -> None:
    sparse = vecpool.TASKS["sparse"]
    assert not sparse.needs_token_ids(vecpool.PoolingParams(task="sparse"))
    off = vecpool.PoolingParams(task="sparse", exclude_special_tokens=False)
    assert not sparse.needs_token_ids(off)
    with pytest.raises(vecpool.InputError, match="must be true or false"):
        vecpool.PoolingParams(task="sparse", exclude_special_tokens=1)  # type: ignore[arg-type]
    with pytest.raises(
        vecpool.InputError, match="task 'embed' does not accept parameter 'exclude_special_tokens'"
    ):
        splade_engine.encode(TEXTS[:1], task="embed", exclude_special_tokens=True)


# ---- prompt embeds ----------------------------------------------------------------------


def test_prompt_embeds_are_served_unless_special_tokens_are_excluded(
    splade_engine: vecpool.Engine,
) -> None:
    """By default every position is pooled, so no token ids are needed: embeds rows are the
    model's own embedding of those ids, the same rows enter the same forward, and the result
    is bit for bit the token-id one. Excluding special tokens finds them by id: an embeds input
    then fails alone."""
    engine = splade_engine
    ids = [engine.tokenize(t) for t in TEXTS]
    embeds = {"prompt_embeds": engine.embed_tokens(ids[1])}
    default = vecpool.PoolingParams(task="sparse")
    as_ids = engine.pool(ids, default)
    mixed = engine.pool([ids[0], embeds, ids[2]], default)
    for a, b in zip(as_ids, mixed, strict=True):
        assert a.error is None and b.error is None
        assert np.array_equal(a.data, b.data)
    off = vecpool.PoolingParams(task="sparse", exclude_special_tokens=False)
    for a, b in zip(as_ids, engine.pool([ids[0], embeds, ids[2]], off), strict=True):
        assert np.array_equal(a.data, b.data)
    on = vecpool.PoolingParams(task="sparse", exclude_special_tokens=True)
    expected = engine.pool(ids, on)
    results = engine.pool([ids[0], embeds, ids[2]], on)
    assert isinstance(results[1].error, vecpool.RequestFailedError)
    assert (
        "input 1 (prompt_embeds): task 'sparse' with exclude_special_tokens set needs token ids"
        in str(results[1].error)
    )
    for i in (0, 2):
        assert results[i].error is None
        assert np.abs(results[i].data - expected[i].data).max() <= 1e-6
    with pytest.raises(vecpool.RequestFailedError, match="input 1"):
        engine.embed_sparse([TEXTS[0], embeds], exclude_special_tokens=True)
    (vector,) = engine.embed_sparse([embeds])
    assert vector == engine.embed_sparse([ids[1]])[0]


@pytest.mark.parametrize("strategy", ["max", "sum"])
@pytest.mark.parametrize("activation", ["relu", "log1p_relu"])
def test_sparse_head_on_slices_and_unordered_sequences(strategy: str, activation: str) -> None:
    """The head alone: logits computed a few rows at a time (a sequence spanning slices), its
    sequences not in batch order, one sequence of the step not its own; against a loop."""
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 4, 5]
    input_ids = torch.tensor([0, 5, 1, 0, 2, 3, 1, 0, 4, 4, 2, 1])  # ids 0 and 1 are special
    hidden = torch.randn(sum(lengths), 4, generator=gen)
    project = torch.randn(4, 6, generator=gen)
    special = torch.tensor([True, True, False, False, False, False])
    cu = torch.tensor([0, 3, 7, 12])
    meta = PoolingMetadata(
        cu_seqlens=cu,
        lengths=torch.tensor(lengths),
        seq_ids=torch.repeat_interleave(torch.arange(3), torch.tensor(lengths)),
        input_ids=input_ids,
        last_rows=cu[1:] - 1,
    )
    params = [
        vecpool.PoolingParams(task="sparse", exclude_special_tokens=True),
        vecpool.PoolingParams(task="sparse"),
    ]
    batch = HeadBatch(hidden=hidden, meta=meta, seqs=torch.tensor([2, 1]), params=params)
    outputs = [
        SparseHead(lambda rows: rows @ project, special, strategy, activation, slice_tokens=n)(
            batch
        )
        for n in (2, 1024)
    ]
    for seq, exclude, sliced, whole in zip([2, 1], [True, False], *outputs, strict=True):
        rows = [i for i in range(int(cu[seq]), int(cu[seq + 1])) if not exclude or input_ids[i] > 1]
        weights = torch.log1p(torch.relu(hidden[rows] @ project))
        if activation == "log1p_relu":
            weights = torch.log1p(weights)
        expected = weights.max(0).values if strategy == "max" else weights.sum(0)
        assert np.abs(sliced - expected.numpy()).max() <= 1e-6
        assert np.abs(whole - expected.numpy()).max() <= 1e-6


# ---- pruning, token strings -------------------------------------------------------------


def test_splade_pruning_and_tokens(splade_engine: vecpool.Engine) -> None:
    engine = splade_engine
    (full,) = engine.embed_sparse(TEXTS[:1])
    (top,) = engine.embed_sparse(TEXTS[:1], top_k=5)
    assert list(top.items()) == list(full.items())[:5]
    cut = sorted(full.values())[len(full) // 2]
    (above,) = engine.embed_sparse(TEXTS[:1], threshold=cut)
    assert above == {k: v for k, v in full.items() if v > cut}
    (named,) = engine.embed_sparse(TEXTS[:1], top_k=5, return_tokens=True)
    assert list(named) == [engine.tokenizer.id_to_token(i) for i in top]
    assert list(named.values()) == list(top.values())


# ---- over HTTP --------------------------------------------------------------------------


def _b64_npy(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def test_pooling_endpoint_takes_exclude_special_tokens(splade: tuple[Path, Any]) -> None:
    engine = vecpool.Engine(splade[0], device="cpu")
    ids = engine.tokenize(TEXTS[1])
    embeds = {"prompt_embeds": _b64_npy(engine.embed_tokens(ids).float().numpy())}
    every = engine.encode(TEXTS, task="sparse")
    excluded = engine.encode(TEXTS, task="sparse", exclude_special_tokens=True)
    app = create_app(engine, ServerConfig(model_names=("splade",)))
    with TestClient(app) as client:

        def pooling(**body: Any) -> Any:
            return client.post("/pooling", json={"task": "sparse", **body})

        response = pooling(input=[TEXTS[0], embeds, TEXTS[2]])
        assert response.status_code == 200, response.text
        got = [np.array(d["data"], dtype=np.float32) for d in response.json()["data"]]
        for a, b in zip(got, every, strict=True):
            assert np.array_equal(a, b)
        response = pooling(input=TEXTS, exclude_special_tokens=True)
        assert response.status_code == 200, response.text
        got = [np.array(d["data"], dtype=np.float32) for d in response.json()["data"]]
        for a, b in zip(got, excluded, strict=True):
            assert np.array_equal(a, b)
        response = pooling(input=[TEXTS[0], embeds], exclude_special_tokens=True)
        assert response.status_code == 400
        assert "needs token ids" in response.json()["error"]["message"]
        response = pooling(input=TEXTS, exclude_special_tokens="yes")
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "exclude_special_tokens"
        response = client.post(
            "/pooling", json={"input": TEXTS, "task": "embed", "exclude_special_tokens": True}
        )
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "exclude_special_tokens"
