"""BGE-M3's extra heads: an XLM-R folder with FlagEmbedding's `colbert_linear.pt` and
`sparse_linear.pt` next to its weights. The base model stays the plain XLM-R; these files add a
multi-vector projection (`token_embed`, late-interaction scores) and lexical weights (`sparse`)
computed from the same forward's hidden states (see `vecpool.pooling.build`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vecpool.errors import ModelLoadError

COLBERT_FILE = "colbert_linear.pt"
SPARSE_FILE = "sparse_linear.pt"

# The tokens FlagEmbedding gives no lexical weight, by tokenizer_config.json key, with
# XLM-R's defaults for a key the file leaves out.
_UNUSED_TOKENS = (
    ("cls_token", "<s>"),
    ("eos_token", "</s>"),
    ("pad_token", "<pad>"),
    ("unk_token", "<unk>"),
)


@dataclass(frozen=True)
class BgeM3Spec:
    """BGE-M3's heads, each a state dict of a `torch.nn.Linear` with bias saved by FlagEmbedding:
    `colbert_linear.pt` (hidden -> hidden) projects every token but the first (its CLS) to a
    multi-vector row; `sparse_linear.pt` (hidden -> 1) gives every token the lexical weight
    `relu(sparse_linear(h))`, and a sequence keeps the largest weight of each token id, none for
    `unused_token_ids`."""

    colbert_linear: Path | None
    sparse_linear: Path | None
    unused_token_ids: tuple[int, ...] = ()  # the tokenizer's cls, eos, pad and unk token ids


def read_bge_m3(root: Path, tokenizer_config: dict[str, Any]) -> BgeM3Spec | None:
    """The folder's BGE-M3 heads, or None when it has neither file."""
    colbert, sparse = root / COLBERT_FILE, root / SPARSE_FILE
    if not (colbert.is_file() or sparse.is_file()):
        return None
    return BgeM3Spec(
        colbert_linear=colbert if colbert.is_file() else None,
        sparse_linear=sparse if sparse.is_file() else None,
        unused_token_ids=_unused_token_ids(root, tokenizer_config) if sparse.is_file() else (),
    )


def _unused_token_ids(root: Path, tokenizer_config: dict[str, Any]) -> tuple[int, ...]:
    """The ids of the cls, eos, pad and unk tokens the tokenizer files name, as FlagEmbedding
    looks them up."""
    special_map = _read_json(root / "special_tokens_map.json")
    vocab = _token_ids(root / "tokenizer.json")
    ids = set()
    for key, default in _UNUSED_TOKENS:
        name = _token_name(tokenizer_config.get(key, special_map.get(key, default)))
        if name is None:
            continue
        token_id = vocab.get(name)
        if token_id is None:
            raise ModelLoadError(
                f"{root / SPARSE_FILE}: the {key} {name!r} (left out of lexical weights) is not "
                f"in {root / 'tokenizer.json'}"
            )
        ids.add(token_id)
    return tuple(sorted(ids))


def _token_ids(path: Path) -> dict[str, int]:
    """token -> id of a tokenizers file: its added tokens, then its model's vocabulary."""
    if not path.is_file():
        raise ModelLoadError(
            f"{path.parent / SPARSE_FILE} needs the tokenizer's cls, eos, pad and unk token ids "
            f"(left out of lexical weights), but the folder has no {path.name}"
        )
    data = _read_json(path)
    ids: dict[str, int] = {}
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):  # WordPiece, BPE, WordLevel
        ids.update({str(k): int(v) for k, v in vocab.items()})
    elif isinstance(vocab, list):  # Unigram (sentencepiece): [piece, score] by id
        ids.update({str(entry[0]): i for i, entry in enumerate(vocab)})
    for token in data.get("added_tokens") or ():
        ids[str(token["content"])] = int(token["id"])
    return ids


def _token_name(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken as tokenizer_config.json stores it
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
    return data if isinstance(data, dict) else {}
