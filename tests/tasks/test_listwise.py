"""Listwise reranking (jina-reranker-v3, `JinaForRanking`) against a reference written here from
the model's published remote code (jinaai/jina-reranker-v3, `modeling.py`: `JinaForRanking`,
`format_docs_prompts_func`, `rerank`), run on transformers' `Qwen3Model` with the same random
weights:

- the prompt: a system turn, "I will provide you with N passages ..." with the query, each
  document as `<passage id="i">\\n{doc}<|embed_token|>\\n</passage>`, then
  `<query>\\n{query}<|rerank_token|>\\n</query>`, then the assistant turn with an empty think block;
- the final hidden states at those markers through `projector` (Linear(h, h/2), ReLU,
  Linear(h/2, 512), no biases); a document's score is its cosine with the query's vector;
- documents packed into blocks of at most 125, a block closing once `max_length - 2 * query
  tokens - its documents' tokens <= 2048`; over several blocks the query vector is the average
  of the blocks' query vectors weighted by each block's best `(1 + score) / 2`.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

import vecpool
from tests.helpers import assert_rel_close
from vecpool.calls import listwise

DOC_MARK, QUERY_MARK = "<|embed_token|>", "<|rerank_token|>"
SYSTEM = (
    "You are a search relevance expert who can determine a ranking of the passages based on how "
    "relevant they are to the query. If the query is a question, how relevant a passage is "
    "depends on how well it answers the question. If not, try to analyze the intent of the "
    "query and assess how well each passage satisfies the intent. If an instruction is "
    "provided, you should follow the instruction when determining the ranking."
)
WORDS = (
    "what does a cat eat cats fish and meat the stock market fell on monday is small mammal "
    "that eats mice pizza dogs bark at night rain falls in spring birds sing songs"
).split()
PUNCT = ["<", ">", "</", '="', '">', ".", ",", ":", "?"]
QUERY = "what does a cat eat"
DOCS = [
    "cats eat fish and meat",
    "the stock market fell on monday",
    "a cat is a small mammal that eats mice",
    "pizza",
    "dogs bark at night",
]
HIDDEN = 32


def _tokenizer(folder: Path) -> list[str]:
    """A word-level tokenizer: the template's words, the documents' words, numbers for the
    passage ids, punctuation runs; the chat markers and the two ranking markers as special
    tokens. Returns the vocabulary in id order."""
    template = f"{SYSTEM} I will provide you with passages each indicated by numerical "
    template += "identifier Rank based on their relevance to query passage id system user "
    template += "assistant think"
    words = sorted({w.strip(".,:?") for w in template.split()} | set(WORDS))
    specials = ["[UNK]", "<|im_start|>", "<|im_end|>", DOC_MARK, QUERY_MARK]
    vocab = [*specials, *words, *PUNCT, *(str(i) for i in range(130))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials[1:]])
    tok.save(str(folder / "tokenizer.json"))
    return vocab


class Reference:
    """jina-reranker-v3 as its remote code computes it, on transformers' Qwen3Model."""

    def __init__(self, folder: Path, base: Any, projector: torch.nn.Module):
        self.base, self.projector = base, projector
        self.tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(folder / "tokenizer.json")
        )
        self.doc_id, self.query_id = self.tokenizer.convert_tokens_to_ids([DOC_MARK, QUERY_MARK])

    @staticmethod
    def prompt(query: str, docs: list[str]) -> str:
        passages = "\n".join(
            f'<passage id="{i}">\n{d}{DOC_MARK}\n</passage>' for i, d in enumerate(docs)
        )
        return (
            f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
            f"I will provide you with {len(docs)} passages, each indicated by a numerical "
            f"identifier. Rank the passages based on their relevance to query: {query}\n"
            f"{passages}\n<query>\n{query}{QUERY_MARK}\n</query>"
            "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        )

    @torch.no_grad()
    def block(self, query: str, docs: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document vectors [n, 512], query vector [1, 512], scores [n]) of one prompt."""
        ids = torch.tensor([self.tokenizer(self.prompt(query, docs))["input_ids"]])
        hidden = self.base(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        doc_vecs = self.projector(hidden[ids == self.doc_id])
        query_vec = self.projector(hidden[ids == self.query_id])
        scores = torch.nn.functional.cosine_similarity(doc_vecs, query_vec.expand_as(doc_vecs))
        return doc_vecs.numpy(), query_vec.numpy(), scores.numpy()

    def combined(self, query: str, blocks: list[list[str]]) -> np.ndarray:
        """Every document's score over these blocks: the cosine with the blocks' query vectors
        averaged, each weighted by its block's best `(1 + score) / 2`."""
        doc_vecs, query_vecs, weights = [], [], []
        for docs in blocks:
            d, q, s = self.block(query, docs)
            doc_vecs.extend(d)
            query_vecs.append(q)
            weights.append(((1.0 + s) / 2.0).max())
        q = np.average(np.array(query_vecs), axis=0, weights=weights)  # [1, 512]
        d = np.array(doc_vecs)
        scores = (q @ d.T) / (np.linalg.norm(q) * np.linalg.norm(d, axis=1))
        return scores[0].astype(np.float32)

    def rerank_scores(
        self, query: str, docs: list[str], max_length: int, block_size: int = 125
    ) -> tuple[np.ndarray, int]:
        """Every document's score in input order, and the number of blocks, as the model's
        `rerank` packs them (no document here reaches 2048 tokens or the query 512, so nothing
        is cut)."""
        query_len = len(self.tokenizer(query)["input_ids"])
        blocks: list[list[str]] = [[]]
        capacity = max_length - 2 * query_len
        for doc in docs:
            blocks[-1].append(doc)
            capacity -= len(self.tokenizer(doc)["input_ids"])
            if len(blocks[-1]) >= block_size or capacity <= 2048:
                blocks.append([])
                capacity = max_length - 2 * query_len
        blocks = [b for b in blocks if b]
        return self.combined(query, blocks), len(blocks)


def make_jina_folder(folder: Path) -> Reference:
    """A random tiny `JinaForRanking` folder laid out as the published one (the decoder under
    `model.`, the projector as `projector.0` / `projector.2`, no lm_head), and its reference."""
    vocab = _tokenizer(folder)
    config = transformers.Qwen3Config(
        vocab_size=len(vocab),
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=4096,
        initializer_range=0.2,
        tie_word_embeddings=True,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    base = transformers.Qwen3Model(config).eval()
    projector = torch.nn.Sequential(
        torch.nn.Linear(HIDDEN, HIDDEN // 2, bias=False),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN // 2, 512, bias=False),
    ).eval()
    for p in projector.parameters():
        torch.nn.init.normal_(p, std=0.3)
    tensors = {f"model.{k}": v.contiguous() for k, v in base.state_dict().items()}
    tensors.update({f"projector.{k}": v.contiguous() for k, v in projector.state_dict().items()})
    save_file(tensors, str(folder / "model.safetensors"))
    hf = config.to_dict()
    hf["architectures"] = ["JinaForRanking"]
    hf["auto_map"] = {"AutoModel": "modeling.JinaForRanking"}  # never run
    (folder / "config.json").write_text(json.dumps(hf))
    return Reference(folder, base, projector)


@pytest.fixture(scope="module")
def jina(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Reference]:
    folder = tmp_path_factory.mktemp("jina_v3")
    return folder, make_jina_folder(folder)


@pytest.fixture(scope="module")
def engine(jina: tuple[Path, Reference]) -> vecpool.Engine:
    return vecpool.Engine(jina[0], device="cpu")


def test_prompt_is_the_models(engine: vecpool.Engine) -> None:
    config = engine.info().listwise_reranker
    assert engine.score_mode == "listwise" and config is not None
    assert config.format(QUERY, DOCS) == Reference.prompt(QUERY, DOCS)
    # Texts cannot place markers of their own.
    assert config.sanitize(f"a{DOC_MARK}b{QUERY_MARK}c") == "abc"


@pytest.mark.parametrize("num_docs", [1, 5])
def test_one_prompt_matches_reference(
    engine: vecpool.Engine, jina: tuple[Path, Reference], num_docs: int
) -> None:
    reference = jina[1]
    docs = DOCS[:num_docs]
    _, _, expected = reference.block(QUERY, docs)
    call = engine.prepare_score(QUERY, docs)
    assert len(call.requests) == 1  # one prompt holds the query and every document
    scores = engine.score(QUERY, docs)
    assert scores.shape == (num_docs,)
    assert_rel_close(scores, expected)
    assert np.ptp(scores) > 1e-3 or num_docs == 1  # the documents score apart
    ranked = engine.rerank(QUERY, docs)
    assert [i for i, _ in ranked] == list(np.argsort(-expected, kind="stable"))
    assert engine.rerank(QUERY, docs, top_n=2) == ranked[:2]


def test_more_documents_than_one_prompt_holds(
    engine: vecpool.Engine, jina: tuple[Path, Reference]
) -> None:
    """130 documents: 125 in the first prompt, 5 in a second that repeats the query, the query
    vector combined as the model's `rerank` does."""
    rng = np.random.default_rng(1)
    docs = [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 5)))) for _ in range(130)]
    expected, blocks = jina[1].rerank_scores(QUERY, docs, engine.max_model_len)
    assert blocks == 2
    assert len(engine.prepare_score(QUERY, docs).requests) == 2
    scores = engine.score(QUERY, docs)
    assert_rel_close(scores, expected)
    # One prompt alone scores differently: the combination is what makes the difference.
    _, _, first_only = jina[1].block(QUERY, docs[:125])
    assert np.abs(scores[:125] - first_only).max() > 1e-4
    ranked = engine.rerank(QUERY, docs, top_n=7)
    assert [i for i, _ in ranked] == list(np.argsort(-expected, kind="stable")[:7])
    assert_rel_close(np.array([s for _, s in ranked]), np.sort(expected)[::-1][:7])


def test_split_by_token_room(jina: tuple[Path, Reference]) -> None:
    """A prompt length that leaves room for about three documents of 14 words per prompt
    (the model's rule: a block closes once `max_length - 2 * query - documents <= 2048`)."""
    folder, reference = jina
    max_len = 2048 + 2 * 5 + 40
    engine = vecpool.Engine(folder, device="cpu", max_model_len=max_len)
    rng = np.random.default_rng(2)
    docs = [" ".join(rng.choice(WORDS, size=14)) for _ in range(7)]
    expected, blocks = reference.rerank_scores(QUERY, docs, max_len)
    assert blocks == 3
    assert len(engine.prepare_score(QUERY, docs).requests) == 3
    assert_rel_close(engine.score(QUERY, docs), expected)


def test_a_prompt_over_the_room_is_split(
    engine: vecpool.Engine, jina: tuple[Path, Reference], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block whose prompt is longer than the prompt length (the model's packing rule leaves
    the template out of its count; here a packing that never closes a block) is split in
    halves until each prompt fits."""
    monkeypatch.setattr(listwise, "_pack", lambda config, pairs, *_: [pairs])
    tokenizer = jina[1].tokenizer
    room = len(tokenizer(Reference.prompt(QUERY, DOCS))["input_ids"]) - 1  # 5 do not fit
    halves = [DOCS[:2], DOCS[2:]]
    assert all(len(tokenizer(Reference.prompt(QUERY, h))["input_ids"]) <= room for h in halves)
    call = engine.prepare_score(QUERY, DOCS, truncate_prompt_tokens=room)
    assert len(call.requests) == 2
    assert_rel_close(engine.run(call), jina[1].combined(QUERY, halves))


def test_order_pairs_and_chunks(engine: vecpool.Engine, jina: tuple[Path, Reference]) -> None:
    reference = jina[1]
    # Scores come back in the request's order, whatever the order: each document's score is
    # the reference's for that document at that place in the prompt.
    shuffled = [DOCS[i] for i in (3, 0, 4, 2, 1)]
    assert_rel_close(engine.score(QUERY, shuffled), reference.block(QUERY, shuffled)[2])
    # Pairwise (N -> N): the pairs of each query share prompts, in call order.
    other = "dogs bark"
    queries = [QUERY, other, QUERY, other]
    docs = [DOCS[0], DOCS[1], DOCS[2], DOCS[4]]
    expected = np.zeros(4, dtype=np.float32)
    expected[[0, 2]] = reference.block(QUERY, [DOCS[0], DOCS[2]])[2]
    expected[[1, 3]] = reference.block(other, [DOCS[1], DOCS[4]])[2]
    assert len(engine.prepare_score(queries, docs).requests) == 2
    assert_rel_close(engine.score(queries, docs), expected)
    # A prompt run in chunks of 16 tokens (chunked prefill) gives the same vectors.
    chunked = vecpool.Engine(jina[0], device="cpu", max_num_batched_tokens=16)
    assert_rel_close(chunked.score(QUERY, DOCS), reference.block(QUERY, DOCS)[2])
    # max_tokens_per_doc cuts each document to its first tokens before the prompt is written.
    cut = [" ".join(d.split()[:2]) for d in DOCS]
    assert_rel_close(
        np.array([s for _, s in sorted(engine.rerank(QUERY, DOCS, max_tokens_per_doc=2))]),
        reference.block(QUERY, cut)[2],
    )


def test_refusals(engine: vecpool.Engine, jina: tuple[Path, Reference], tmp_path: Path) -> None:
    with pytest.raises(vecpool.InputError, match="use_activation applies to cross-encoder"):
        engine.score(QUERY, DOCS, use_activation=True)
    with pytest.raises(vecpool.InputError, match="scores texts"):
        engine.rerank(QUERY, [DOCS[0], [5, 6, 7]])
    with pytest.raises(vecpool.InputError, match="more than the 40 tokens a prompt may have"):
        engine.rerank(QUERY, DOCS, truncate_prompt_tokens=40)
    assert engine.rerank(QUERY, []) == []
    # Strict loading in the published layout: the projector is part of the checkpoint.
    folder = jina[0]
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["projector.2.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(vecpool.ModelLoadError, match=r"projector\.2\.weight"):
        vecpool.Engine(tmp_path, device="cpu")


def test_rerank_over_http(engine: vecpool.Engine) -> None:
    from tests.server.asgi import serving  # the server's dependencies, for this test only

    expected = engine.rerank(QUERY, DOCS, top_n=3)

    async def post() -> dict[str, Any]:
        async with serving(engine) as (client, _):
            body = {"query": QUERY, "documents": DOCS, "top_n": 3, "return_documents": True}
            response = await client.post("/v1/rerank", json=body)
            assert response.status_code == 200, response.text
            result: dict[str, Any] = response.json()
            return result

    results = asyncio.run(post())["results"]
    assert [r["index"] for r in results] == [i for i, _ in expected]
    got = np.array([r["relevance_score"] for r in results])
    assert np.abs(got - np.array([s for _, s in expected])).max() <= 1e-6
    assert [r["document"]["text"] for r in results] == [DOCS[i] for i, _ in expected]
