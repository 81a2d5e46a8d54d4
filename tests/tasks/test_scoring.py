"""score and rerank: cross-encoders against sentence-transformers, LLM rerankers against a direct
transformers computation, late interaction (ColBERT) against numpy, embeddings by cosine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from sentence_transformers import CrossEncoder
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

import vecpool
from tests.helpers import assert_rel_close, batch_sizes_of, save_hf_model
from tests.models.test_decoders import ARCHS, VOCAB
from vecpool.inputs import tokenizer as tokenizer_module
from vecpool.inputs.wordpiece import ArrayWordPiece

QUERY = "what does a cat eat"
DOCS = [
    "cats eat fish and meat",
    "the stock market fell sharply on monday",
    "a cat is a small carnivorous mammal that eats mice",
    "pizza",
]


def test_cross_encoder_matches_sentence_transformers(
    cross_encoder: tuple[Path, Any], cross_encoder_engine: vecpool.Engine
) -> None:
    engine = cross_encoder_engine
    reference = CrossEncoder(str(cross_encoder[0]), device="cpu")
    expected = reference.predict([(QUERY, d) for d in DOCS])  # sigmoid of one logit
    assert engine.score_mode == "cross_encoder"
    one_to_many = engine.score(QUERY, DOCS)
    assert one_to_many.shape == (len(DOCS),)
    assert_rel_close(one_to_many, expected)
    pairwise = engine.score([QUERY, DOCS[0]], [DOCS[2], DOCS[1]])
    assert_rel_close(pairwise, reference.predict([(QUERY, DOCS[2]), (DOCS[0], DOCS[1])]))
    (single,) = engine.score(QUERY, DOCS[2])
    assert abs(single - expected[2]) <= 1e-6
    raw = engine.score(QUERY, DOCS, use_activation=False)
    assert_rel_close(1 / (1 + np.exp(-raw)), expected)
    assert np.ptp(expected) > 1e-3  # the scores tell the documents apart


def test_rerank_sorts_best_first(cross_encoder_engine: vecpool.Engine) -> None:
    engine = cross_encoder_engine
    scores = engine.score(QUERY, DOCS)
    ranked = engine.rerank(QUERY, DOCS)  # the same pairs in the same batch: the same bits
    assert [i for i, _ in ranked] == list(np.argsort(-scores, kind="stable"))
    assert [s for _, s in ranked] == sorted(scores.tolist(), reverse=True)
    assert engine.rerank(QUERY, DOCS, top_n=2) == ranked[:2]
    assert engine.rerank(QUERY, []) == []


def test_pairs_tokenize_as_transformers(
    cross_encoder: tuple[Path, Any], cross_encoder_engine: vecpool.Engine
) -> None:
    """The pair template, segment ids, and longest-first truncation that keeps [CLS]/[SEP]."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(cross_encoder[0]))
    engine = cross_encoder_engine
    long_doc = " ".join(DOCS * 3)
    for limit in (None, 12, 20):
        inputs = [{"text": QUERY, "text_pair": long_doc}, {"text": long_doc, "text_pair": "a"}]
        prompts = engine.inputs.process(inputs, vecpool.TextOptions(truncate_prompt_tokens=limit))
        for item, prompt in zip(inputs, prompts, strict=True):
            expected = tokenizer(
                item["text"], item["text_pair"], truncation=limit is not None, max_length=limit
            )
            assert prompt.token_ids is not None and prompt.token_type_ids is not None
            assert prompt.token_ids.tolist() == expected["input_ids"]
            assert prompt.token_type_ids.tolist() == expected["token_type_ids"]
    # Truncated pairs score as the truncated reference does.
    reference = CrossEncoder(str(cross_encoder[0]), device="cpu", max_length=16)
    ours = engine.score(QUERY, [long_doc, DOCS[0]], truncate_prompt_tokens=16)
    assert_rel_close(ours, reference.predict([(QUERY, long_doc), (QUERY, DOCS[0])]))


def test_a_large_rerank_call_scores_as_sentence_transformers(
    cross_encoder: tuple[Path, Any],
    cross_encoder_engine: vecpool.Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call large enough for the array path of WordPiece pairs (`encode_pairs`, taken once)
    scores as sentence-transformers does, and bit for bit as the same call through the
    library: the same prompts, in the same steps."""
    calls = batch_sizes_of(monkeypatch, ArrayWordPiece, "encode_pairs")
    docs = [f"{d}, and {e}" for d in DOCS for e in DOCS]
    scores = cross_encoder_engine.score(QUERY, docs)
    assert calls == [len(docs)]
    reference = CrossEncoder(str(cross_encoder[0]), device="cpu")
    assert_rel_close(scores, reference.predict([(QUERY, d) for d in docs]))
    monkeypatch.setattr(tokenizer_module, "WORDPIECE_MIN_CHARS", 1 << 62)
    assert np.array_equal(cross_encoder_engine.score(QUERY, docs), scores)
    assert calls == [len(docs)]  # the library's this time


def test_score_rejects_mismatched_sides(cross_encoder_engine: vecpool.Engine) -> None:
    with pytest.raises(vecpool.InputError, match="no room for a text pair besides 3 special"):
        cross_encoder_engine.score("a b", "c d", truncate_prompt_tokens=4)
    too_long = cross_encoder_engine.max_model_len + 1
    with pytest.raises(vecpool.InputError, match=f"={too_long} is more than the model's limit"):
        cross_encoder_engine.rerank("a b", ["c d"], truncate_prompt_tokens=too_long)
    with pytest.raises(vecpool.InputError, match="first side has 2 inputs and the second 3"):
        cross_encoder_engine.score(["a", "b"], ["c", "d", "e"])
    with pytest.raises(vecpool.InputError, match=r"input 1 \(text_2\).*scores texts"):
        cross_encoder_engine.score("a", ["b", [5, 6, 7]])


# ---- LLM rerankers ---------------------------------------------------------------------------

WORDS = "yes no what does a cat eat cats fish and meat the stock market Query Document Instruct"


def _word_tokenizer(path: Path) -> None:
    """A word-level tokenizer over a tiny vocabulary, with the chat markers as special tokens."""
    specials = ["[UNK]", "<|im_start|>", "<|im_end|>"]
    vocab = {w: i for i, w in enumerate([*specials, *WORDS.split(), "<", ">:", ":"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials[1:]])
    tok.save(str(path / "tokenizer.json"))


@pytest.mark.parametrize(
    ("arch_name", "tied"), [("qwen3", False), ("gemma2", True)], ids=["qwen3", "gemma2-softcap"]
)
@pytest.mark.parametrize("false_token", ["no", None])
def test_llm_reranker_matches_transformers(
    arch_name: str, tied: bool, false_token: str | None, tmp_path: Path
) -> None:
    arch = next(a for a in ARCHS if a.name == arch_name)
    hf = arch.hf_model(causal_lm=True, tie_word_embeddings=tied)
    folder = save_hf_model(hf, tmp_path)
    _word_tokenizer(folder)
    config = vecpool.LLMRerankerConfig.qwen3(instruction="find what cats eat")
    if false_token is None:
        config = vecpool.LLMRerankerConfig(config.template, "yes", None, config.instruction)
    engine = vecpool.Engine(folder, device="cpu", llm_reranker=config)
    assert engine.score_mode == "llm"
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    yes, no = tokenizer.convert_tokens_to_ids(["yes", "no"])
    expected = []
    for doc in DOCS:
        prompt = config.format(QUERY, doc)
        assert "<|im_start|>assistant" in prompt and f"<Document>: {doc}" in prompt
        ids = tokenizer(prompt)["input_ids"]
        assert max(ids) < VOCAB
        with torch.no_grad():
            last = hf(input_ids=torch.tensor([ids])).logits[0, -1]
        log_odds = last[yes] - last[no] if false_token else last[yes]
        expected.append(float(log_odds))
    raw = engine.score(QUERY, DOCS, use_activation=False)
    assert_rel_close(raw, np.array(expected, dtype=np.float32))
    assert_rel_close(engine.score(QUERY, DOCS), 1 / (1 + np.exp(-np.array(expected))))
    ranked = engine.rerank(QUERY, DOCS, top_n=3)
    assert [i for i, _ in ranked] == list(np.argsort(-np.array(expected), kind="stable")[:3])
    # Truncation cuts the documents only: the template and the query stay whole.
    long_doc = " ".join(["cats eat fish and meat"] * 6)
    full_len = len(tokenizer(config.format(QUERY, long_doc))["input_ids"])
    limit = full_len - 7
    kept = long_doc.split()[: len(long_doc.split()) - 7]
    cut_right = config.format(QUERY, " ".join(kept))
    assert len(tokenizer(cut_right)["input_ids"]) == limit
    right = engine.score(QUERY, [long_doc], truncate_prompt_tokens=limit, use_activation=False)
    assert_rel_close(right, engine.score(QUERY, [" ".join(kept)], use_activation=False))
    left = engine.score(
        QUERY,
        [long_doc],
        truncate_prompt_tokens=limit,
        truncation_side="left",
        use_activation=False,
    )
    tail = " ".join(long_doc.split()[7:])
    assert_rel_close(left, engine.score(QUERY, [tail], use_activation=False))
    assert not np.allclose(right, engine.score(QUERY, [long_doc], use_activation=False))
    with pytest.raises(vecpool.InputError, match="without its document takes more than 8 tokens"):
        engine.score(QUERY, DOCS, truncate_prompt_tokens=8)
    # -1 is the limit, which these prompts fit: the same prompts, the same computation.
    assert np.array_equal(
        engine.score(QUERY, DOCS, truncate_prompt_tokens=-1), engine.score(QUERY, DOCS)
    )
    limit = engine.max_model_len
    with pytest.raises(vecpool.InputError, match=f"={limit + 1} is more than the model's limit"):
        engine.score(QUERY, DOCS, truncate_prompt_tokens=limit + 1)


def test_llm_reranker_config_errors(tmp_path: Path) -> None:
    with pytest.raises(vecpool.ConfigError, match=r"no \{document\} placeholder"):
        vecpool.LLMRerankerConfig("Query: {query}")
    arch = next(a for a in ARCHS if a.name == "qwen3")
    folder = save_hf_model(arch.hf_model(causal_lm=True), tmp_path)
    _word_tokenizer(folder)
    bad = vecpool.LLMRerankerConfig("{query} {document}", true_token="maybe")
    with pytest.raises(vecpool.ConfigError, match="'maybe' is not in the vocabulary"):
        vecpool.Engine(folder, device="cpu", llm_reranker=bad)
    # Text that looks like a placeholder stays as it is.
    plain = vecpool.LLMRerankerConfig("Q: {query} D: {document}")
    assert plain.format("{document}", "x") == "Q: {document} D: x"


# ---- late interaction ------------------------------------------------------------------------


def test_colbert_vectors_match_a_direct_computation(
    colbert: tuple[Path, Any, torch.Tensor],
) -> None:
    folder, hf, linear = colbert
    engine = vecpool.Engine(folder, device="cpu")
    assert engine.score_mode == "late_interaction"
    assert engine.token_output_dim == 16
    texts = [QUERY, *DOCS]
    ours = engine.encode(texts, task="token_embed")
    for text, vectors in zip(texts, ours, strict=True):
        ids = torch.tensor([engine.tokenize(text)])
        with torch.no_grad():
            projected = hf(input_ids=ids).last_hidden_state[0] @ linear.T
        expected = torch.nn.functional.normalize(projected, dim=-1).numpy()
        assert_rel_close(vectors, expected)


def _numpy_maxsim(q: np.ndarray, d: np.ndarray) -> float:
    return float(sum(max(float(qi @ dj) for dj in d) for qi in q))


def test_maxsim_scores_match_numpy(colbert: tuple[Path, Any, torch.Tensor]) -> None:
    engine = vecpool.Engine(colbert[0], device="cpu")
    # score writes its first side as ColBERT queries, the second as documents.
    (query,) = engine.encode([QUERY], task="token_embed", input_type="query")
    docs = engine.encode(DOCS, task="token_embed", input_type="document")
    expected = np.array([_numpy_maxsim(query, d) for d in docs], dtype=np.float32)
    call = engine.prepare_score(QUERY, DOCS)
    assert len(call.requests) == 1 + len(DOCS)  # the query's vectors are computed once
    assert_rel_close(engine.run(call), expected)
    assert_rel_close(engine.score(QUERY, DOCS), expected)
    pairwise = engine.score([QUERY, DOCS[1]], [DOCS[0], DOCS[2]])
    (query_1,) = engine.encode([DOCS[1]], task="token_embed", input_type="query")
    assert_rel_close(pairwise, np.array([expected[0], _numpy_maxsim(query_1, docs[2])]))
    ranked = engine.rerank(QUERY, DOCS)
    assert [i for i, _ in ranked] == list(np.argsort(-expected, kind="stable"))
    with pytest.raises(vecpool.InputError, match="use_activation applies to cross-encoder"):
        engine.score(QUERY, DOCS, use_activation=False)


def test_colbert_projection_size_from_config(
    colbert: tuple[Path, Any, torch.Tensor], tmp_path: Path
) -> None:
    import shutil

    folder = shutil.copytree(colbert[0], tmp_path / "colbert")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "colbert_dim": 8}))
    with pytest.raises(vecpool.ModelLoadError, match=r"linear\.weight"):
        vecpool.Engine(folder, device="cpu")  # the checkpoint's projection is 16 wide


def test_embedding_models_score_by_cosine(minilm: vecpool.Engine) -> None:
    assert minilm.score_mode == "embed"
    vectors = minilm.embed([QUERY, *DOCS])
    expected = vectors[1:] @ vectors[0]
    assert_rel_close(minilm.score(QUERY, DOCS), expected)


LONG = "word " * 200  # over the tiny models' 128 tokens and MiniLM's 256


@pytest.mark.parametrize("engine_name", ["cross_encoder_engine", "minilm"])
def test_errors_name_the_side_at_fault(engine_name: str, request: pytest.FixtureRequest) -> None:
    engine: vecpool.Engine = request.getfixturevalue(engine_name)
    long = LONG * 2
    with pytest.raises(vecpool.InputError, match="maximum context length") as caught:
        engine.score(long, DOCS)
    assert (caught.value.field, caught.value.index) == ("text_1", 0)
    with pytest.raises(vecpool.InputError, match="maximum context length") as caught:
        engine.score(QUERY, [DOCS[0], long])
    assert (caught.value.field, caught.value.index) == ("text_2", 1)
    with pytest.raises(vecpool.InputError, match="maximum context length") as caught:
        engine.rerank(long, DOCS)
    assert (caught.value.field, caught.value.index) == ("query", None)
    with pytest.raises(vecpool.InputError, match="maximum context length") as caught:
        engine.rerank(QUERY, [DOCS[0], long])
    assert (caught.value.field, caught.value.index) == ("documents", 1)
    with pytest.raises(vecpool.InputError) as caught:
        engine.rerank(QUERY, [DOCS[0], ""])
    assert (caught.value.field, caught.value.index) == ("documents", 1)


def test_a_pair_too_long_together_blames_the_document(
    cross_encoder_engine: vecpool.Engine,
) -> None:
    # Each side fits alone (under 128 tokens); together they do not: the document is cut.
    half = "word " * 70
    with pytest.raises(vecpool.InputError, match="maximum context length") as caught:
        cross_encoder_engine.score(half, half)
    assert (caught.value.field, caught.value.index) == ("text_2", 0)


def test_a_classifier_with_several_labels_does_not_score(
    tmp_path: Path, default_model_dir: Path
) -> None:
    from tests.tasks.conftest import tiny_bert_head, with_minilm_tokenizer

    hf = tiny_bert_head(transformers.BertForSequenceClassification, num_labels=2)
    folder = with_minilm_tokenizer(save_hf_model(hf, tmp_path / "two_labels"), default_model_dir)
    engine = vecpool.Engine(folder, device="cpu")
    assert engine.score(QUERY, DOCS).shape == (len(DOCS), 2)  # the Python API: every label
    for call in (
        lambda: engine.prepare_rerank(QUERY, DOCS),
        lambda: vecpool.api.calls.prepare_score(engine.context, QUERY, DOCS, one_score=True),
    ):
        with pytest.raises(vecpool.InputError, match="classifier with 2 labels") as caught:
            call()
        assert (caught.value.field, caught.value.index) == (None, None)


def test_rerank_use_activation_and_max_tokens_per_doc(
    cross_encoder_engine: vecpool.Engine, minilm: vecpool.Engine
) -> None:
    engine = cross_encoder_engine
    raw = engine.score(QUERY, DOCS, use_activation=False)
    ranked = engine.rerank(QUERY, DOCS, use_activation=False)
    assert [s for _, s in ranked] == sorted(raw.tolist(), reverse=True)
    assert max(raw) > 1  # logits, not probabilities
    # Documents cut to their first 3 tokens, at a token boundary of the text.
    cut = [minilm.detokenize(minilm.tokenize(d)[1:4]) for d in DOCS]
    assert cut[1] == "the stock market"
    for model in (engine, minilm):
        expected = model.rerank(QUERY, cut)
        got = model.rerank(QUERY, DOCS, max_tokens_per_doc=3)
        assert [i for i, _ in got] == [i for i, _ in expected]
        assert np.allclose([s for _, s in got], [s for _, s in expected], atol=1e-6)
    with pytest.raises(vecpool.InputError, match="positive integer") as caught:
        minilm.rerank(QUERY, DOCS, max_tokens_per_doc=0)
    assert caught.value.field == "max_tokens_per_doc"
    # Documents in the other input forms are cut too: token ids and prompt embeds by count.
    ids = [minilm.tokenize(d) for d in DOCS]
    expected = minilm.rerank(QUERY, [i[:3] for i in ids])
    rng = np.random.default_rng(7)
    embeds = [rng.standard_normal((len(i), 384)).astype(np.float32) for i in ids]
    for form in (tuple, np.array, torch.tensor, lambda i: {"prompt_token_ids": i}):
        got = minilm.rerank(QUERY, [form(i) for i in ids], max_tokens_per_doc=3)
        assert [i for i, _ in got] == [i for i, _ in expected]
        assert np.allclose([s for _, s in got], [s for _, s in expected], atol=1e-6)
    got = minilm.rerank(QUERY, [{"prompt_embeds": e} for e in embeds], max_tokens_per_doc=3)
    expected = minilm.rerank(QUERY, [{"prompt_embeds": e[:3]} for e in embeds])
    assert np.allclose(sorted(s for _, s in got), sorted(s for _, s in expected), atol=1e-6)
    with pytest.raises(vecpool.InputError, match="not valid Unicode") as caught:
        minilm.rerank(QUERY, ["fine", "a\ud800"], max_tokens_per_doc=3)
    assert (caught.value.index, caught.value.field) == (1, "documents")
