"""Late interaction as its references write it: queries and documents of PyLate and
sentence-transformers multi-vector folders against sentence-transformers 6's `MultiVectorEncoder`
on the same random weights, and an `HF_ColBERT` folder against a direct computation of Stanford
ColBERT's encoding (marker after [CLS], [MASK] expansion, skiplist, projection, normalize)."""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file
from sentence_transformers.base.modules import Normalize, Transformer
from sentence_transformers.base.modules.dense import Dense
from sentence_transformers.multi_vector_encoder import MultiVectorEncoder
from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

import vecpool
from tests.helpers import assert_rel_close
from tests.tasks.conftest import tiny_bert_head, with_minilm_tokenizer
from vecpool.tasks import PoolingParams

QUERIES = ["what do cats eat?", "fish", "Who feeds the cat, and when?"]
DOCS = [
    "Cats eat fish, mostly; and mice!",
    "Pizza is food.",
    "Dogs (sometimes) eat the cats' food: fish, meat & rice.",
]
LONG_QUERY = "what do cats and dogs and birds and fish eat in the winter months"
LONG_DOC = " ".join(["the cat sat on the mat, then it ate the fish."] * 5)


def _bert_folder(dest: Path, default_model_dir: Path) -> Path:
    """A random tiny BERT (MiniLM vocabulary and tokenizer) saved as a transformers folder."""
    hf = tiny_bert_head(transformers.BertModel)
    hf.save_pretrained(str(dest))
    return with_minilm_tokenizer(dest, default_model_dir)


def _projection(seed: int) -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(seed)) * 0.3


@pytest.fixture(scope="module")
def pylate_folder(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A PyLate save: Transformer and a bias-free Dense, its settings at the top level of
    config_sentence_transformers.json (markers [unused0] / [unused1], queries of 12 tokens whose
    [MASK] expansion is not attended to, documents of at most 40, PyLate's default skiplist)."""
    folder = _bert_folder(tmp_path_factory.mktemp("pylate"), default_model_dir)
    (folder / "1_Dense").mkdir()
    dense_config = {"in_features": 32, "out_features": 16, "bias": False}
    (folder / "1_Dense" / "config.json").write_text(
        json.dumps({**dense_config, "activation_function": "torch.nn.modules.linear.Identity"})
    )
    save_file({"linear.weight": _projection(5)}, str(folder / "1_Dense" / "model.safetensors"))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64}))
    st_config = {
        "model_type": "ColBERT",
        "prompts": {},
        "default_prompt_name": None,
        "query_prefix": "[unused0]",
        "document_prefix": "[unused1]",
        "query_length": 12,
        "document_length": 40,
        "attend_to_expansion_tokens": False,
    }
    (folder / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    return folder


@pytest.fixture(scope="module")
def native_folder(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A `MultiVectorEncoder` built from sentence-transformers' own modules and saved: text
    prompts, queries expanded to at least 8 tokens with the expansion attended to, a skiplist
    on both sides, MeanMaxSim."""
    bert = _bert_folder(tmp_path_factory.mktemp("bert"), default_model_dir)
    dense = Dense(32, 16, bias=False, module_input_name="token_embeddings")
    with torch.no_grad():
        dense.linear.weight.copy_(_projection(6))
    model = MultiVectorEncoder(
        modules=[
            Transformer(
                str(bert),
                query_length=20,
                document_length=40,
                query_expansion={"strategy": "min", "attend": True, "length": 8},
            ),
            dense,
            MultiVectorMask(skiplist_words=list("?!,."), skiplist_tasks=["query", "document"]),
            Normalize(module_input_name="token_embeddings"),
        ],
        prompts={"query": "query: ", "document": "passage: "},
        similarity_fn_name="meanmaxsim",
        device="cpu",
    )
    folder = tmp_path_factory.mktemp("native")
    model.save(str(folder))
    return folder


@pytest.fixture(scope="module")
def resaved_folder(tmp_path_factory: pytest.TempPathFactory, pylate_folder: Path) -> Path:
    """The PyLate folder loaded by sentence-transformers and saved in its own format: the
    markers become text prompts and special tokens of tokenizer.json."""
    folder = tmp_path_factory.mktemp("resaved")
    MultiVectorEncoder(str(pylate_folder), device="cpu").save(str(folder))
    return folder


def _assert_vectors_equal(ours: list[np.ndarray], reference: list[np.ndarray]) -> None:
    for i, (a, b) in enumerate(zip(ours, reference, strict=True)):
        assert a.shape == b.shape, (i, a.shape, b.shape)
        diff = float(np.abs(a - b).max())
        assert diff <= 1e-5, f"input {i}: max abs diff {diff:.3e}"


@pytest.mark.parametrize("name", ["pylate_folder", "native_folder", "resaved_folder"])
def test_vectors_and_scores_match_sentence_transformers(
    name: str, request: pytest.FixtureRequest
) -> None:
    folder: Path = request.getfixturevalue(name)
    reference = MultiVectorEncoder(str(folder), device="cpu")
    engine = vecpool.Engine(folder, device="cpu")
    assert engine.score_mode == "late_interaction"
    queries = reference.encode_query(QUERIES, convert_to_numpy=True)
    docs = reference.encode_document(DOCS, convert_to_numpy=True)
    _assert_vectors_equal(engine.encode(QUERIES, task="token_embed", input_type="query"), queries)
    _assert_vectors_equal(engine.encode(DOCS, task="token_embed", input_type="document"), docs)
    # Scores: each query's vectors once against every document, in one batch with them.
    expected = reference.similarity(queries, docs).numpy()  # [num_queries, num_docs]
    for i, query in enumerate(QUERIES):
        assert_rel_close(engine.score(query, DOCS), expected[i])
    pairwise = engine.score(QUERIES, DOCS)
    assert_rel_close(pairwise, np.diag(expected).astype(np.float32))
    ranked = engine.rerank(QUERIES[0], DOCS)
    assert [i for i, _ in ranked] == list(np.argsort(-expected[0], kind="stable"))


def test_the_sides_are_written_as_configured(pylate_folder: Path, native_folder: Path) -> None:
    pylate = vecpool.Engine(pylate_folder, device="cpu")
    plain = pylate.encode(DOCS, task="token_embed")  # as given: no marker, no skiplist
    documents = pylate.encode(DOCS, task="token_embed", input_type="document")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(pylate_folder))
    for doc, rows, marked in zip(DOCS, plain, documents, strict=True):
        punctuation = sum(1 for t in tokenizer.tokenize(doc) if t in string.punctuation)
        assert punctuation > 0
        assert marked.shape[0] == rows.shape[0] + 1 - punctuation  # the marker in, punctuation out
    queries = pylate.encode(QUERIES, task="token_embed", input_type="query")
    assert [q.shape for q in queries] == [(12, 16)] * len(QUERIES)  # expanded to 12 tokens
    # Queries are written alike in any batch: with documents, or alone.
    alone = [pylate.encode([q], task="token_embed", input_type="query")[0] for q in QUERIES]
    for together, single in zip(queries, alone, strict=True):
        assert_rel_close(together, single, rtol=1e-6)
    # "min" expansion: short queries reach 8 tokens, longer ones keep their length; "?" skipped.
    native = vecpool.Engine(native_folder, device="cpu")
    lengths = [q.shape[0] for q in native.encode(QUERIES, task="token_embed", input_type="query")]
    assert lengths == [8, 8, 10]


def test_lengths_are_limits_unless_truncated(pylate_folder: Path) -> None:
    reference = MultiVectorEncoder(str(pylate_folder), device="cpu")
    engine = vecpool.Engine(pylate_folder, device="cpu")
    with pytest.raises(vecpool.InputError, match="maximum context length for a query of 12 tokens"):
        engine.encode([LONG_QUERY], task="token_embed", input_type="query")
    with pytest.raises(
        vecpool.InputError, match="maximum context length for a document of 40 tokens"
    ):
        engine.encode([LONG_DOC], task="token_embed", input_type="document")
    # Truncated to the side's limit, as the reference always does.
    query = engine.encode(
        [LONG_QUERY], task="token_embed", input_type="query", truncate_prompt_tokens=-1
    )
    doc = engine.encode(
        [LONG_DOC], task="token_embed", input_type="document", truncate_prompt_tokens=-1
    )
    _assert_vectors_equal(query, reference.encode_query([LONG_QUERY], convert_to_numpy=True))
    _assert_vectors_equal(doc, reference.encode_document([LONG_DOC], convert_to_numpy=True))
    # A shorter truncation counts the marker; a query is still expanded to its 12 tokens.
    (short,) = engine.encode(
        [LONG_QUERY], task="token_embed", input_type="query", truncate_prompt_tokens=5
    )
    words = " ".join(LONG_QUERY.split()[:2])
    (expected,) = engine.encode([words], task="token_embed", input_type="query")
    assert short.shape == (12, 16)
    assert_rel_close(short, expected, rtol=1e-6)


def test_prompt_embeds_with_a_side_fail_alone(pylate_folder: Path) -> None:
    engine = vecpool.Engine(pylate_folder, device="cpu")
    embeds = engine.embed_tokens(engine.tokenize(DOCS[1]))
    params = PoolingParams(task="token_embed", input_type="document")
    results = engine.pool([DOCS[0], {"prompt_embeds": embeds}], params)
    expected = engine.encode([DOCS[0]], task="token_embed", input_type="document")[0]
    assert results[0].error is None and results[0].data is not None
    assert np.array_equal(results[0].data, expected)
    assert isinstance(results[1].error, vecpool.RequestFailedError)
    assert "with input_type set needs token ids" in str(results[1].error)
    # In score and rerank, whose sides get their markers, the error names the side at fault.
    doc = {"prompt_embeds": embeds}
    for call, field, index in (
        (lambda: engine.rerank(doc, DOCS), "query.prompt_embeds", None),
        (lambda: engine.rerank(DOCS[0], [DOCS[0], doc]), "documents.prompt_embeds", 1),
        (lambda: engine.score(doc, DOCS), "text_1.prompt_embeds", 0),
        (lambda: engine.score(DOCS[0], [DOCS[0], doc]), "text_2.prompt_embeds", 1),
    ):
        with pytest.raises(vecpool.RequestFailedError, match="needs token ids") as info:
            call()
        assert (info.value.field, info.value.index) == (field, index)
    # Without a side, prompt embeds are served as the ids they embed.
    (as_ids,) = engine.encode([engine.tokenize(DOCS[1])], task="token_embed")
    (as_embeds,) = engine.encode([{"prompt_embeds": embeds}], task="token_embed")
    assert np.array_equal(as_ids, as_embeds)


def test_input_type_errors(minilm: vecpool.Engine, pylate_folder: Path) -> None:
    with pytest.raises(vecpool.InputError, match="needs a late-interaction model"):
        minilm.encode(["cats"], task="token_embed", input_type="query")
    with pytest.raises(vecpool.InputError, match="does not accept parameter 'input_type'"):
        minilm.encode(["cats"], task="embed", input_type="query")
    with pytest.raises(vecpool.InputError, match=r"must be one of \['query', 'document'\]"):
        PoolingParams(task="token_embed", input_type="passage")
    engine = vecpool.Engine(pylate_folder, device="cpu")
    with pytest.raises(vecpool.InputError, match="a text pair has no query side"):
        engine.encode([{"text": "a", "text_pair": "b"}], task="token_embed", input_type="query")
    with pytest.raises(vecpool.InputError, match="leaves no room"):
        engine.encode(["cats"], task="token_embed", input_type="query", truncate_prompt_tokens=3)


# ---- HF_ColBERT -------------------------------------------------------------------------------


@torch.no_grad()
def _stanford_colbert(
    folder: Path,
    hf: Any,
    linear: torch.Tensor,
    text: str,
    *,
    query: bool,
    max_length: int | None,
    marker: str,
    attend_to_mask: bool = False,
    mask_punctuation: bool = True,
) -> np.ndarray:
    """Stanford ColBERT's encoding of one text, computed directly: a placeholder after [CLS]
    swapped for the marker; a query padded to its length and its padding turned into [MASK]
    (attended to or not); BERT, the projection, L2 norm; punctuation rows out of documents."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    enc = tokenizer(
        ". " + text,
        padding="max_length" if query else False,
        truncation=max_length is not None,
        max_length=max_length,
    )
    ids = torch.tensor(enc["input_ids"])
    mask = torch.tensor(enc["attention_mask"])
    ids[1] = tokenizer.convert_tokens_to_ids(marker)
    if query:
        ids[ids == tokenizer.pad_token_id] = tokenizer.mask_token_id
        if attend_to_mask:
            mask[:] = 1
    hidden = hf(input_ids=ids[None], attention_mask=mask[None]).last_hidden_state[0]
    vectors = torch.nn.functional.normalize(hidden @ linear.T, dim=-1)
    if not query and mask_punctuation:
        skip = torch.tensor(tokenizer.convert_tokens_to_ids(list(string.punctuation)))
        vectors = vectors[~torch.isin(ids, skip)]
    return vectors.numpy()


def test_hf_colbert_defaults_match_a_direct_computation(
    colbert: tuple[Path, Any, torch.Tensor],
) -> None:
    """No artifact.metadata: [unused0] / [unused1], queries of 32 tokens with [MASK] that is not
    attended to, punctuation left out of documents."""
    folder, hf, linear = colbert
    engine = vecpool.Engine(folder, device="cpu")
    queries = engine.encode(QUERIES, task="token_embed", input_type="query")
    docs = engine.encode(DOCS, task="token_embed", input_type="document")
    for text, ours in zip(QUERIES, queries, strict=True):
        expected = _stanford_colbert(
            folder, hf, linear, text, query=True, max_length=32, marker="[unused0]"
        )
        assert ours.shape == (32, 16)
        _assert_vectors_equal([ours], [expected])
    for text, ours in zip(DOCS, docs, strict=True):
        expected = _stanford_colbert(
            folder, hf, linear, text, query=False, max_length=None, marker="[unused1]"
        )
        _assert_vectors_equal([ours], [expected])
    scores = engine.score(QUERIES[0], DOCS)
    expected_scores = [float((queries[0] @ d.T).max(axis=1).sum()) for d in docs]
    assert_rel_close(scores, np.array(expected_scores, dtype=np.float32))


def test_hf_colbert_artifact_metadata(
    colbert: tuple[Path, Any, torch.Tensor], tmp_path: Path
) -> None:
    folder, hf, linear = colbert
    folder = shutil.copytree(folder, tmp_path / "colbert")
    metadata = {
        "query_token_id": "[unused2]",
        "doc_token_id": "[unused3]",
        "query_maxlen": 10,
        "doc_maxlen": 40,
        "attend_to_mask_tokens": True,
        "mask_punctuation": False,
    }
    (folder / "artifact.metadata").write_text(json.dumps({"config": metadata}))
    engine = vecpool.Engine(folder, device="cpu")
    (query,) = engine.encode([QUERIES[0]], task="token_embed", input_type="query")
    (doc,) = engine.encode([DOCS[0]], task="token_embed", input_type="document")
    expected_query = _stanford_colbert(
        folder,
        hf,
        linear,
        QUERIES[0],
        query=True,
        max_length=10,
        marker="[unused2]",
        attend_to_mask=True,
    )
    expected_doc = _stanford_colbert(
        folder,
        hf,
        linear,
        DOCS[0],
        query=False,
        max_length=40,
        marker="[unused3]",
        mask_punctuation=False,
    )
    _assert_vectors_equal([query, doc], [expected_query, expected_doc])
    with pytest.raises(
        vecpool.InputError, match="maximum context length for a document of 40 tokens"
    ):
        engine.encode([LONG_DOC], task="token_embed", input_type="document")


# ---- folders that are refused ----------------------------------------------------------------


def _edit_json(path: Path, **changes: Any) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_unsupported_settings_are_refused(
    native_folder: Path, colbert: tuple[Path, Any, torch.Tensor], tmp_path: Path
) -> None:
    mask_only = shutil.copytree(native_folder, tmp_path / "mask")
    mask_config = next(mask_only.glob("*_MultiVectorMask")) / "config.json"
    _edit_json(mask_config, keep_only_token_ids=[5])
    with pytest.raises(vecpool.ModelLoadError, match="keep_only_token_ids"):
        vecpool.Engine(mask_only, device="cpu")

    pooled = shutil.copytree(native_folder, tmp_path / "pooled")
    modules = json.loads((pooled / "modules.json").read_text())
    modules.append(
        {
            "idx": len(modules),
            "name": str(len(modules)),
            "path": "",
            "type": "sentence_transformers.multi_vector_encoder.modules.HierarchicalTokenPooling",
        }
    )
    (pooled / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(vecpool.ModelLoadError, match="'HierarchicalTokenPooling'"):
        vecpool.Engine(pooled, device="cpu")

    short = shutil.copytree(native_folder, tmp_path / "short")
    _edit_json(short / "sentence_bert_config.json", query_length=4)
    with pytest.raises(vecpool.ModelLoadError, match="below the query expansion length 8"):
        vecpool.Engine(short, device="cpu")

    l2 = shutil.copytree(colbert[0], tmp_path / "l2")
    (l2 / "artifact.metadata").write_text(json.dumps({"similarity": "l2"}))
    with pytest.raises(vecpool.ModelLoadError, match="similarity 'l2' is not supported"):
        vecpool.Engine(l2, device="cpu")
