"""BGE-M3's three outputs (dense, sparse lexical weights, colbert vectors) from one XLM-R
forward, against a reference written here from FlagEmbedding's definition.

Read for the reference: FlagOpen/FlagEmbedding `finetune/embedder/encoder_only/m3/modeling.py`
(`EncoderOnlyEmbedderM3Model`: `_dense_embedding`, `_sparse_embedding`, `_colbert_embedding`,
`EncoderOnlyEmbedderM3ModelForInference.forward`) and `inference/embedder/encoder_only/m3.py`
(`M3Embedder`: `_process_token_weights`, `_process_colbert_vecs`, `colbert_score`):
- dense: the CLS row of the last hidden states, L2-normalized;
- sparse: `relu(sparse_linear(h))` per token, scattered onto the vocabulary with `amax` (a
  repeated token id keeps its largest weight), the cls, eos, pad and unk ids zeroed;
- colbert: `colbert_linear(h[:, 1:])` (every token but the CLS, the eos kept, padding cut),
  L2-normalized; score: `sum_i max_j q_i . d_j / len(q)`.
The reference runs transformers' XLMRobertaModel on a padded batch, as FlagEmbedding does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

import vecpool
from tests.helpers import assert_rel_close, save_hf_model, write_st_modules
from vecpool.errors import ModelLoadError, RequestFailedError
from vecpool.pooling.heads import _not_prompt_first
from vecpool.pooling.methods import PoolingMetadata

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]  # ids 0..3, as XLM-R's
WORDS = (
    "the cat sat on mat a dog ran to park and fish swim in sea under blue sky with red hat "
    "small big old new tree house river road stone light"
).split()
VOCAB = len(SPECIALS) + len(WORDS) + 1  # <mask> last, as XLM-R's
HIDDEN = 32
# Mixed lengths, repeated words, an unknown word ("zebra": <unk>), the mask token in the text.
TEXTS = [
    "the cat sat on the mat the cat",
    "dog",
    "zebra the the river zebra",
    "a big old dog ran to the park and the small cat sat under the big tree by the river "
    "road with a red hat and the dog ran",
    "<mask> fish swim in the blue sea",
]
QUERY = "the cat sat in the house"


def _tokenizer(folder: Path) -> None:
    """An XLM-R-like sentencepiece (Unigram) tokenizer: <s> text </s>, specials at XLM-R's ids."""
    pieces = [(s, 0.0) for s in SPECIALS] + [(f"\u2581{w}", -1.0) for w in WORDS]
    tok = Tokenizer(models.Unigram([*pieces, ("<mask>", 0.0)], unk_id=3, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.add_special_tokens([AddedToken(s, special=True) for s in [*SPECIALS, "<mask>"]])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)],
    )
    tok.save(str(folder / "tokenizer.json"))
    names = {"cls_token": "<s>", "bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>"}
    names.update({"pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>"})
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 64, **names}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def _st_files(folder: Path) -> None:
    """sentence-transformers modules as bge-m3 ships them: Transformer, CLS Pooling, Normalize."""
    write_st_modules(folder, HIDDEN, "cls_token")


class M3:
    """The tiny model: transformers' XLM-R, FlagEmbedding's two linears, the tokenizer."""

    def __init__(self, folder: Path):
        torch.manual_seed(9)
        cfg = transformers.XLMRobertaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=37,
            max_position_embeddings=66,
            type_vocab_size=1,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
        )
        self.model = transformers.XLMRobertaModel(cfg).eval()
        self.colbert = torch.nn.Linear(HIDDEN, HIDDEN)
        self.sparse = torch.nn.Linear(HIDDEN, 1)
        with torch.no_grad():  # about half the tokens get a positive lexical weight
            self.sparse.bias.zero_()
        save_hf_model(self.model, folder)
        _tokenizer(folder)
        _st_files(folder)
        torch.save(self.colbert.state_dict(), folder / "colbert_linear.pt")
        torch.save(self.sparse.state_dict(), folder / "sparse_linear.pt")
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
        self.unused = [
            self.tokenizer.cls_token_id,
            self.tokenizer.eos_token_id,
            self.tokenizer.pad_token_id,
            self.tokenizer.unk_token_id,
        ]

    @torch.no_grad()
    def reference(self, texts: list[str]) -> dict[str, Any]:
        batch = self.tokenizer(texts, padding=True, return_tensors="pt")
        ids, mask = batch["input_ids"], batch["attention_mask"]
        h = self.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, L, H]
        weights = torch.relu(self.sparse(h)).squeeze(-1)  # [B, L]
        sparse = torch.zeros(len(texts), VOCAB).scatter_reduce(-1, ids, weights, reduce="amax")
        sparse[:, self.unused] = 0.0
        colbert = self.colbert(h[:, 1:]) * mask[:, 1:, None].float()
        colbert = F.normalize(colbert, dim=-1)
        lengths = mask.sum(1).tolist()
        return {
            "ids": [ids[i, :n].tolist() for i, n in enumerate(lengths)],
            "weights": [weights[i, :n] for i, n in enumerate(lengths)],
            "dense": F.normalize(h[:, 0], dim=-1).numpy(),
            "sparse": sparse.numpy(),
            "colbert": [colbert[i, : n - 1].numpy() for i, n in enumerate(lengths)],
        }


@pytest.fixture(scope="module")
def m3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, M3]:
    folder = tmp_path_factory.mktemp("bge_m3")
    return folder, M3(folder)


@pytest.fixture(scope="module")
def engine(m3: tuple[Path, M3]) -> vecpool.Engine:
    return vecpool.Engine(m3[0], device="cpu")


def _dense_sparse(weights: list[dict[int, float]]) -> np.ndarray:
    out = np.zeros((len(weights), VOCAB), dtype=np.float32)
    for row, vector in zip(out, weights, strict=True):
        for token_id, weight in vector.items():
            row[token_id] = weight
    return out


def test_inputs_exercise_what_the_reference_distinguishes(m3: tuple[Path, M3]) -> None:
    """The texts hold repeated ids of different positive weights (max, not sum or last), unk,
    the mask token, and zero weights: otherwise the sparse comparison could not fail."""
    ref = m3[1].reference(TEXTS)
    ids = torch.tensor(ref["ids"][0])
    weights = ref["weights"][0]
    repeated = [int(i) for i in ids.unique() if (ids == i).sum() > 1 and i not in m3[1].unused]
    assert any(
        (weights[ids == i] > 0).sum() > 1 and weights[ids == i].unique().numel() > 1
        for i in repeated
    )
    assert 3 in ref["ids"][2] and VOCAB - 1 in ref["ids"][4]
    assert ref["sparse"][4, VOCAB - 1] > 0  # the mask token has a lexical weight
    assert (torch.cat(ref["weights"]) == 0).any() and (torch.cat(ref["weights"]) > 0).any()
    assert len({len(i) for i in ref["ids"]}) == len(TEXTS)


def test_dense_is_the_normalized_cls_row(engine: vecpool.Engine, m3: tuple[Path, M3]) -> None:
    ref = m3[1].reference(TEXTS)
    assert_rel_close(np.asarray(engine.embed(TEXTS)), ref["dense"])


def test_dense_matches_sentence_transformers(engine: vecpool.Engine, m3: tuple[Path, M3]) -> None:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(m3[0]), device="cpu")
    expected = st.encode(TEXTS, convert_to_numpy=True)
    assert_rel_close(np.asarray(engine.embed(TEXTS)), expected)


def test_sparse_lexical_weights(engine: vecpool.Engine, m3: tuple[Path, M3]) -> None:
    ref = m3[1].reference(TEXTS)
    weights = engine.embed_sparse(TEXTS)
    for vector in weights:
        assert not set(vector) & set(m3[1].unused)
    assert VOCAB - 1 in weights[4]  # <mask> is not one of the unused tokens
    assert_rel_close(_dense_sparse(weights), ref["sparse"])
    # One text alone gives what it gives in the mixed batch.
    alone = _dense_sparse(engine.embed_sparse(TEXTS[:1]))
    assert_rel_close(alone, ref["sparse"][:1])


def test_sparse_exclude_special_tokens_also_drops_mask(
    engine: vecpool.Engine, m3: tuple[Path, M3]
) -> None:
    """Leaving the special tokens out drops the mask token's weight and keeps the others, to
    the bit: the lexical head weighs every row of a sequence whatever a request leaves out
    (the product has one shape either way), and drops the left-out rows after."""
    text = TEXTS[4]
    (kept,) = engine.embed_sparse([text])
    (excluded,) = engine.embed_sparse([text], exclude_special_tokens=True)
    assert VOCAB - 1 in kept and VOCAB - 1 not in excluded
    assert {k: v for k, v in kept.items() if k != VOCAB - 1} == excluded


def test_colbert_vectors(engine: vecpool.Engine, m3: tuple[Path, M3]) -> None:
    ref = m3[1].reference(TEXTS)
    ours = engine.encode(TEXTS, task="token_embed")
    for got, want, ids in zip(ours, ref["colbert"], ref["ids"], strict=True):
        assert got.shape == (len(ids) - 1, HIDDEN)  # every token but the CLS, the eos kept
        assert_rel_close(got, want)
    assert engine.info().token_output_dim == HIDDEN


def test_scores_are_dense_by_default(engine: vecpool.Engine, m3: tuple[Path, M3]) -> None:
    """As sentence-transformers, TEI and vLLM score BGE-M3: the cosine of dense vectors."""
    assert engine.score_mode == "embed"
    ref = m3[1].reference([QUERY, *TEXTS])["dense"]
    np.testing.assert_allclose(engine.score(QUERY, TEXTS), ref[1:] @ ref[0], rtol=1e-5, atol=1e-6)


def test_colbert_score_is_mean_maxsim(m3: tuple[Path, M3]) -> None:
    engine = vecpool.Engine(m3[0], device="cpu", score_mode="late_interaction")
    ref = m3[1].reference([QUERY, *TEXTS])
    q = torch.from_numpy(ref["colbert"][0])
    expected = [
        float((q @ torch.from_numpy(d).T).max(-1).values.sum() / q.shape[0])
        for d in ref["colbert"][1:]
    ]
    scores = engine.score(QUERY, TEXTS)
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-6)


def test_sparse_from_prompt_embeds_fails_alone(engine: vecpool.Engine, m3: tuple[Path, M3]) -> None:
    """Lexical weights are read at the token ids: prompt embeds cannot give them, and say so;
    the input given as ids in the same call is served."""
    ids = m3[1].reference(TEXTS[:1])["ids"][0]
    outs = engine.pool(
        [{"prompt_embeds": engine.embed_tokens(ids)}, {"prompt_token_ids": ids}],
        vecpool.PoolingParams(task="sparse"),
    )
    assert isinstance(outs[0].error, RequestFailedError)
    assert "token ids" in str(outs[0].error) and "prompt embeds" in str(outs[0].error)
    assert outs[1].error is None


def test_prompt_embeds_match_ids_bit_exact(engine: vecpool.Engine, m3: tuple[Path, M3]) -> None:
    ids = m3[1].reference(TEXTS[:1])["ids"][0]
    embeds = {"prompt_embeds": engine.embed_tokens(ids)}
    by_ids = {"prompt_token_ids": ids}
    assert np.abs(engine.embed([embeds])[0] - engine.embed([by_ids])[0]).max() == 0.0
    (a,), (b,) = (engine.encode([x], task="token_embed") for x in (embeds, by_ids))
    assert a.shape == b.shape and np.abs(a - b).max() == 0.0


@pytest.mark.parametrize("budget", [4, 11])
def test_small_token_budget(m3: tuple[Path, M3], budget: int) -> None:
    """A token budget below the batch and the longest prompt: the texts run over several steps
    (an encoder runs each prompt whole), every output as in one padded batch."""
    small = vecpool.Engine(m3[0], device="cpu", max_num_batched_tokens=budget)
    texts = [TEXTS[3], TEXTS[0], TEXTS[1]]
    ref = m3[1].reference(texts)
    assert_rel_close(np.asarray(small.embed(texts)), ref["dense"])
    assert_rel_close(_dense_sparse(small.embed_sparse(texts)), ref["sparse"])
    for got, want in zip(small.encode(texts, task="token_embed"), ref["colbert"], strict=True):
        assert_rel_close(got, want)


def test_first_token_of_a_prompt_not_of_a_chunk() -> None:
    """The CLS left out of the colbert rows is a prompt's first token: a sequence that continues
    a prompt (a chunk starting at position 4) keeps its first row."""
    meta = PoolingMetadata(
        cu_seqlens=torch.tensor([0, 3, 5, 7]),
        lengths=torch.tensor([3, 2, 2]),
        seq_ids=torch.tensor([0, 0, 0, 1, 1, 2, 2]),
        input_ids=torch.zeros(7, dtype=torch.int64),
        last_rows=torch.tensor([2, 4, 6]),
        starts=torch.tensor([0, 4, 0]),
    )
    keep = _not_prompt_first(meta).tolist()
    assert keep == [False, True, True, True, True, False, True]
    meta.starts = None
    assert _not_prompt_first(meta).tolist() == [False, True, True, False, True, False, True]


@pytest.fixture(scope="module")
def plain(m3: tuple[Path, M3], tmp_path_factory: pytest.TempPathFactory) -> vecpool.Engine:
    """The same XLM-R folder without the .pt files, nor the sentence-transformers files."""
    folder = tmp_path_factory.mktemp("xlmr_plain")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(m3[0] / name, folder / name)
    return vecpool.Engine(folder, device="cpu")


def test_folder_without_the_pt_files_is_plain_xlm_r(
    plain: vecpool.Engine, m3: tuple[Path, M3]
) -> None:
    hf = m3[1]
    assert plain.folder.bge_m3 is None and plain.folder.late_interaction is None
    assert plain.score_mode == "embed"
    assert "sparse" in plain.info().unavailable_tasks
    # The encoder default (CLS, normalized) is the same dense output.
    assert_rel_close(np.asarray(plain.embed(TEXTS)), hf.reference(TEXTS)["dense"])
    # token_embed: the raw hidden states of every token, CLS included.
    ids = hf.reference(TEXTS[:2])["ids"]
    got = plain.encode(TEXTS[:2], task="token_embed", normalize=False)
    for g, i in zip(got, ids, strict=True):
        with torch.no_grad():
            want = hf.model(input_ids=torch.tensor([i])).last_hidden_state[0].numpy()
        assert_rel_close(g, want)


def test_mis_shaped_pt_file_is_refused(m3: tuple[Path, M3], tmp_path: Path) -> None:
    folder = Path(shutil.copytree(m3[0], tmp_path / "m3"))
    torch.save(torch.nn.Linear(HIDDEN, 8).state_dict(), folder / "colbert_linear.pt")
    with pytest.raises(ModelLoadError, match=r"colbert_linear.*weight.*\[8, 32\]"):
        vecpool.Engine(folder, device="cpu")
    shutil.copy(m3[0] / "colbert_linear.pt", folder / "colbert_linear.pt")
    torch.save({"weight": torch.zeros(1, HIDDEN)}, folder / "sparse_linear.pt")
    with pytest.raises(ModelLoadError, match=r"sparse_linear\.pt.*lacks \['bias'\]"):
        vecpool.Engine(folder, device="cpu")
