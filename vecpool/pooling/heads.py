"""Heads: what a task computes from the rows a pooling method selects.

A head gets the whole step's hidden states and the batch positions of its own sequences; it
selects rows with `vecpool.pooling.methods`, applies the model's own head functions (classifier,
language-model logits, projection) to those rows only, then the task's post-processing
(activation, matryoshka truncation, normalization), and copies its result to the host once.
Several heads serve one step, so that one model folder answers embed, classify and sparse
requests in the same batch. Which heads a model has is decided in `vecpool.pooling.build`.

A sequence may be one chunk of a longer prompt. Sequence heads then merge what they reduce with
what the prompt's earlier chunks left (`HeadBatch.merge`, see `vecpool.pooling.carry`) and
answer at its last chunk; per-token heads (`per_token`) answer every chunk's rows, which the
pooling runner joins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from vecpool.errors import ConfigError
from vecpool.models.layers.basic import activation, activation_name
from vecpool.models.loading.st import DenseStack
from vecpool.pooling.carry import Carry
from vecpool.pooling.methods import (
    METHODS,
    PoolingMetadata,
    marked_rows,
    on_device,
    prompt_lengths,
    sequence_rows,
    token_rows,
)
from vecpool.tasks import PoolingParams

RowFn = Callable[[torch.Tensor], torch.Tensor]  # [n, hidden] -> [n, out]
LogitsFn = Callable[..., torch.Tensor]  # (rows [n, hidden], vocab_ids [v] | None) -> [n, v]

# What a classifier's activation may be (sentence-transformers saves a cross-encoder's as a
# torch class path; `activation_name` reads either form).
CLASSIFIER_ACTIVATIONS = ("sigmoid", "softmax", "identity", "tanh")
_PROBLEM_TYPES = {
    "multi_label_classification": "sigmoid",
    "single_label_classification": "softmax",
    "regression": "identity",
}


@dataclass(frozen=True)
class HeadBatch:
    """The part of one step a head serves."""

    hidden: torch.Tensor  # [num_tokens, hidden] final hidden states of the whole step
    meta: PoolingMetadata
    seqs: torch.Tensor  # [k] int64 on the device: batch positions of the head's sequences
    params: list[PoolingParams]  # [k]
    # Accumulators across the chunks of prompts run over several steps; None: every sequence
    # is a whole prompt.
    carry: Carry | None = None
    # True: `seqs` is every sequence of the step in order (0 .. k - 1), so that the per-sequence
    # values of the step are already the head's, without selecting them.
    every: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.params)

    def pick(self, values: torch.Tensor) -> torch.Tensor:
        """`[k, ...]`: the head's sequences' rows of `[num_seqs, ...]` per-sequence values."""
        return values if self.every else values[self.seqs]

    def merge(self, name: str, values: torch.Tensor, how: str) -> torch.Tensor:
        """`[k, ...]` values of this step's chunks merged with their prompts' earlier chunks'
        (see `Carry.merge`)."""
        return values if self.carry is None else self.carry.merge(name, values, how)

    def final_only(self, outputs: list[np.ndarray]) -> list[np.ndarray | None]:
        """`outputs` of the sequences that end their prompts; None for those that continue."""
        if self.carry is None:
            return list(outputs)
        return [
            out if final else None for out, final in zip(outputs, self.carry.final, strict=True)
        ]

    def flag_values(self, name: str, default: bool) -> list[bool]:
        """Each sequence's boolean parameter `name` (`default` where it is None)."""

        def flag(params: PoolingParams) -> bool:
            value = getattr(params, name)
            return default if value is None else bool(value)

        first = self.params[0]
        if all(p is first for p in self.params):  # one call's requests share their params
            return [flag(first)] * len(self.params)
        return [flag(p) for p in self.params]

    def flags(self, name: str, default: bool) -> torch.Tensor:  # [k] bool on the device
        return on_device(self.seqs.device, self.flag_values(name, default), torch.bool)


class TaskHead(Protocol):
    # True: one output row per token, each chunk's rows answered as it runs (the pooling
    # runner joins a prompt's chunks); False: one output per prompt, at its last chunk.
    per_token: bool
    # True: every request needs its token ids, whatever its task says (the head reads them).
    needs_token_ids: bool
    # Shared-prefix caching: the names of the carried values (see `HeadBatch.merge`) that a
    # cached prefix's float32 hidden-state sum stands for; () when the head needs nothing of
    # a prefix (it reads the last row); None when it needs the prefix's rows (no sharing).
    prefix_carry: tuple[str, ...] | None

    def __call__(self, b: HeadBatch, /) -> list[np.ndarray | None]:
        """One output per sequence of `b`, in its order (None: a sequence head's sequence whose
        prompt continues in a later step)."""
        ...


def classifier_activation(hf: dict[str, Any], num_labels: int) -> str:
    """How a checkpoint's classifier logits become scores: the activation sentence-transformers
    saved with a cross-encoder, else by `problem_type`, else sigmoid for one label and softmax
    for several."""
    st = (hf.get("sentence_transformers") or {}).get("activation_fn") or hf.get(
        "sbert_ce_default_activation_function"
    )
    if st:
        name = str(st).rsplit(".", 1)[-1].lower()
        if name not in CLASSIFIER_ACTIVATIONS:
            raise ConfigError(
                f"the classifier activation {st!r} in config.json is not supported "
                f"(supported: {', '.join(CLASSIFIER_ACTIVATIONS)})"
            )
        return activation_name(name)
    problem = hf.get("problem_type")
    if problem in _PROBLEM_TYPES:
        return _PROBLEM_TYPES[problem]
    return "sigmoid" if num_labels == 1 else "softmax"


def activate(logits: torch.Tensor, kind: str) -> torch.Tensor:
    """`[n, m]` float32 logits through the activation `kind` (softmax over the last axis)."""
    return activation(kind)(logits)


def truncate_and_normalize(
    x: torch.Tensor,  # [n, dim] float32
    dims: torch.Tensor,  # [n] int64: kept leading dimensions per row
    normalize: torch.Tensor,  # [n] bool
) -> torch.Tensor:  # [n, dim]: columns past a row's `dims` are zeroed
    """Matryoshka truncation then L2 normalization, per row, without a Python loop."""
    keep = torch.arange(x.shape[1], device=x.device)[None, :] < dims[:, None]
    x = x * keep
    norms = x.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return torch.where(normalize[:, None], x / norms, x)


def normalize_rows(
    x: torch.Tensor,  # [n, dim] float32
    dims: list[int],  # [n]: kept leading dimensions per row
    normalize: list[bool],  # [n]
) -> torch.Tensor:
    """`truncate_and_normalize` of per-row parameters given on the host. Where no row is cut
    and every row has the same flag (a step's usual case) it runs one norm and one division,
    or nothing: the same values as the general path (its mask multiplies by one and its
    `where` picks one side), without that path's kernels and copies."""
    if all(d >= x.shape[1] for d in dims) and (all(normalize) or not any(normalize)):
        return x / x.norm(dim=1, keepdim=True).clamp_min(1e-12) if normalize[0] else x
    return truncate_and_normalize(
        x,
        on_device(x.device, dims, torch.int64),
        on_device(x.device, normalize, torch.bool),
    )


class EmbedHead:
    """The model's pooling, the folder's Dense projections, matryoshka truncation, normalize."""

    per_token = False
    needs_token_ids = False
    prefix_carry: tuple[str, ...] | None = None

    def __init__(self, pooler: str, dense: DenseStack, normalize: bool, output_dim: int):
        self.pooler, self.dense, self.normalize, self.output_dim = (
            pooler,
            dense,
            normalize,
            output_dim,
        )
        self.prefix_carry = _PREFIX_CARRY.get(pooler, {}).get("pooled")

    def __call__(self, b: HeadBatch) -> list[np.ndarray | None]:
        method = METHODS[self.pooler]
        chunk = b.pick(method.reduce(b.hidden, b.meta))  # [k, hidden] float32
        merged = b.merge("pooled", chunk, method.merge)
        pooled = merged if method.finish is None else method.finish(merged, _lengths(b))
        dims = [p.dimensions or self.output_dim for p in b.params]
        out = normalize_rows(self.dense(pooled), dims, b.flag_values("normalize", self.normalize))
        host = out.cpu().numpy()
        if all(d == host.shape[1] for d in dims):
            return b.final_only(list(host))  # rows as views, none cut
        return b.final_only([host[i, :d] for i, d in enumerate(dims)])


def _lengths(b: HeadBatch) -> torch.Tensor:
    """`[k]` int64: each of the head's sequences' prompt length up to its end."""
    return b.pick(prompt_lengths(b.meta))


class ClassifierHead:
    """One row per sequence (CLS or LAST), or the mean of its rows (MEAN: ModernBERT's
    `classifier_pooling`), through a classifier, then its activation."""

    per_token = False
    needs_token_ids = False
    prefix_carry: tuple[str, ...] | None = None

    def __init__(self, classify: RowFn, pooler: str, activation: str):
        self.classify, self.pooler, self.activation = classify, pooler, activation
        self.prefix_carry = _PREFIX_CARRY.get(pooler, {}).get("sum" if pooler == "MEAN" else "row")

    def __call__(self, b: HeadBatch) -> list[np.ndarray | None]:
        if self.pooler == "MEAN":
            method = METHODS["MEAN"]
            assert method.finish is not None
            sums = b.merge("sum", b.pick(method.reduce(b.hidden, b.meta)), method.merge)
            mean = method.finish(sums, _lengths(b))  # [k, hidden] float32
            rows = mean.to(b.hidden.dtype)
        else:
            rows = b.hidden[sequence_rows(self.pooler, b.meta, None if b.every else b.seqs)]
            # A prompt's first row is its first chunk's; its last row, its last chunk's.
            rows = b.merge("row", rows, "first" if self.pooler == "CLS" else "last")
        logits = self.classify(rows).float()  # [k, num_labels]
        scores = torch.where(
            b.flags("use_activation", True)[:, None], activate(logits, self.activation), logits
        )
        return b.final_only(list(scores.cpu().numpy()))


class LogitScoreHead:
    """An LLM reranker: the last position's logits of a "true" token (and a "false" one) give
    the log-odds `l_true - l_false` (or `l_true` alone), scored through a sigmoid."""

    per_token = False
    needs_token_ids = False
    prefix_carry: tuple[str, ...] | None = ()  # the last row only

    def __init__(self, compute_logits: LogitsFn, vocab_ids: torch.Tensor):
        self.compute_logits = compute_logits
        self.vocab_ids = vocab_ids  # [1 or 2] int64: the true token, then the false one

    def __call__(self, b: HeadBatch) -> list[np.ndarray | None]:
        # A prompt's last chunk's last row is its last row.
        rows = b.hidden[sequence_rows("LAST", b.meta, None if b.every else b.seqs)]
        logits = self.compute_logits(rows, self.vocab_ids).float()  # [k, 1 or 2]
        raw = logits[:, :1] if logits.shape[1] == 1 else logits[:, :1] - logits[:, 1:2]
        scores = torch.where(b.flags("use_activation", True)[:, None], torch.sigmoid(raw), raw)
        return b.final_only(list(scores.cpu().numpy()))


class TokenEmbedHead:
    """Per-token vectors (all tokens, or STEP-tagged ones): an optional projection (ColBERT's
    `linear`, a multi-vector folder's Dense modules), matryoshka truncation, normalize.

    A late-interaction model may leave the tokens of a skiplist (punctuation) out of the vectors
    of one side: of the requests whose `input_type` is in `skip_sides`; with `drop_first`
    (BGE-M3) every prompt's first token (its CLS) gets no vector."""

    per_token = True
    needs_token_ids = False
    prefix_carry: tuple[str, ...] | None = None

    def __init__(
        self,
        project: RowFn | None,
        normalize: bool,
        output_dim: int,
        skiplist: torch.Tensor | None = None,  # [vocab] bool: token ids left out
        skip_sides: frozenset[str] = frozenset(),
        drop_first: bool = False,
    ):
        self.project, self.normalize, self.output_dim = project, normalize, output_dim
        self.skiplist, self.skip_sides, self.drop_first = skiplist, skip_sides, drop_first

    def __call__(self, b: HeadBatch) -> list[np.ndarray | None]:
        keep = None
        skipping = [p.input_type in self.skip_sides for p in b.params]
        if self.skiplist is not None and any(skipping):
            skip_seq = torch.zeros(b.meta.lengths.shape[0], dtype=torch.bool, device=b.seqs.device)
            skip_seq[b.seqs] = on_device(b.seqs.device, skipping, torch.bool)
            keep = ~(skip_seq[b.meta.seq_ids] & self.skiplist[b.meta.input_ids])
        if self.drop_first:
            keep = _not_prompt_first(b.meta) if keep is None else keep & _not_prompt_first(b.meta)
        selected, row_seq, counts = _token_rows(b, keep)
        rows = b.hidden[selected]
        if self.project is not None:
            rows = self.project(rows)
        dims = [p.dimensions or self.output_dim for p in b.params]
        rows = truncate_and_normalize(
            rows.float(),
            on_device(b.seqs.device, dims, torch.int64)[row_seq],
            b.flags("normalize", self.normalize)[row_seq],
        )
        parts = torch.split(rows.cpu(), counts)
        return [part.numpy()[:, :d] for part, d in zip(parts, dims, strict=True)]


class TokenClassifierHead:
    """Per-token class scores (all tokens, or STEP-tagged ones) from a token classifier."""

    per_token = True
    needs_token_ids = False
    prefix_carry: tuple[str, ...] | None = None

    def __init__(self, classify_tokens: RowFn, activation: str):
        self.classify_tokens, self.activation = classify_tokens, activation

    def __call__(self, b: HeadBatch) -> list[np.ndarray | None]:
        selected, row_seq, counts = _token_rows(b)
        logits = self.classify_tokens(b.hidden[selected]).float()  # [num_selected, num_labels]
        use = b.flags("use_activation", True)[row_seq]
        scores = torch.where(use[:, None], activate(logits, self.activation), logits)
        return [part.numpy() for part in torch.split(scores.cpu(), counts)]


class ListwiseHead:
    """A listwise reranker (jina-reranker-v3): the rows at its marker tokens (each document's,
    then the query's, in prompt order) through its projector, one `[num_markers, dim]` float32
    block per prompt. The scores (cosines, several prompts of one query combined) are the api
    layer's (`vecpool.calls.listwise`). Markers are found by token id, so requests need them."""

    per_token = True  # each chunk's marker rows; the pooling runner joins a prompt's chunks
    needs_token_ids = True
    prefix_carry: tuple[str, ...] | None = None

    def __init__(self, project: RowFn, marked: torch.Tensor):
        self.project = project
        self.marked = marked  # [vocab] bool: the marker token ids

    def __call__(self, b: HeadBatch) -> list[np.ndarray | None]:
        selected, _, counts = marked_rows(b.meta, b.seqs, self.marked)
        vectors = self.project(b.hidden[selected]).float()  # [num_markers, dim]
        return [part.numpy() for part in torch.split(vectors.cpu(), counts)]


class SparseHead:
    """SPLADE, as sentence-transformers' `SpladePooling`: the masked-LM logits of every token
    through `log1p(relu(x))` (`"relu"`) or `log1p(log1p(relu(x)))` (`"log1p_relu"`), pooled per
    sequence by `max` or `sum` into one `[vocab]` vector. A request with
    `exclude_special_tokens` pools over its non-special tokens only. The vocabulary logits of a
    step's tokens are computed `slice_tokens` rows at a time to bound memory."""

    per_token = False
    needs_token_ids = False
    prefix_carry: tuple[str, ...] | None = None

    def __init__(
        self,
        compute_logits: LogitsFn,
        special: torch.Tensor,
        pooling_strategy: str = "max",
        activation_function: str = "relu",
        slice_tokens: int = 1024,
    ):
        self.compute_logits = compute_logits
        self.special = special  # [vocab] bool: token ids `exclude_special_tokens` leaves out
        self.reduce = {"max": "amax", "sum": "sum"}[pooling_strategy]  # over a sequence's tokens
        self.log1p_twice = {"relu": False, "log1p_relu": True}[activation_function]
        self.slice_tokens = slice_tokens

    def __call__(self, b: HeadBatch) -> list[np.ndarray | None]:
        meta, device = b.meta, b.seqs.device
        num_all = int(meta.lengths.shape[0])
        local = torch.full((num_all,), -1, dtype=torch.int64, device=device)
        local[b.seqs] = torch.arange(b.num_seqs, device=device)
        exclude = torch.zeros(num_all, dtype=torch.bool, device=device)
        exclude[b.seqs] = b.flags("exclude_special_tokens", False)
        row_local = local[meta.seq_ids]  # [num_tokens]: index among the head's sequences
        # Prompt-embeds rows hold id 0 here; their requests never exclude (they need token ids).
        keep = (row_local >= 0) & ~(exclude[meta.seq_ids] & self.special[meta.input_ids])
        token_rows = torch.nonzero(keep).squeeze(1)  # [num_kept]
        # Grouped by sequence, in token order: a sum then adds in one fixed order on every
        # device (segment sums, no atomics).
        token_rows = token_rows[torch.argsort(row_local[token_rows], stable=True)]
        rows, row_local = b.hidden[token_rows], row_local[token_rows]
        out = torch.zeros(b.num_seqs, self.special.shape[0], dtype=torch.float32, device=device)
        for start in range(0, rows.shape[0], self.slice_tokens):
            end = start + self.slice_tokens
            weights = torch.log1p(torch.relu(self.compute_logits(rows[start:end]).float()))
            if self.log1p_twice:
                weights = torch.log1p(weights)
            # Weights are >= 0, so the zeros `out` starts from change neither a max nor a sum.
            if self.reduce == "sum":
                counts = torch.bincount(row_local[start:end], minlength=b.num_seqs)
                # `unsafe`: counts of these very rows (no check that reads them back).
                out += torch.segment_reduce(weights, "sum", lengths=counts, axis=0, unsafe=True)
            else:
                index = row_local[start:end, None].expand_as(weights)
                out.scatter_reduce_(0, index, weights, reduce="amax")
        out = b.merge("weights", out, "sum" if self.reduce == "sum" else "max")
        return b.final_only(list(out.cpu().numpy()))


class LexicalSparseHead:
    """BGE-M3's lexical weights: every token's weight `relu(token_weight(h))`, one `[vocab]`
    vector per sequence holding the largest weight of each token id it contains. The `unused`
    ids (cls, eos, pad, unk) get none; a request with `exclude_special_tokens` leaves out every
    `special` id too. The weights are read at the token ids, so requests need them."""

    per_token = False
    needs_token_ids = True
    prefix_carry: tuple[str, ...] | None = None

    def __init__(self, token_weight: RowFn, unused: torch.Tensor, special: torch.Tensor):
        self.token_weight = token_weight  # [n, hidden] -> [n, 1]
        self.unused = unused  # [vocab] bool
        self.special = special  # [vocab] bool

    def __call__(self, b: HeadBatch) -> list[np.ndarray | None]:
        meta, device = b.meta, b.seqs.device
        num_all, vocab = int(meta.lengths.shape[0]), self.unused.shape[0]
        local = torch.full((num_all,), -1, dtype=torch.int64, device=device)
        local[b.seqs] = torch.arange(b.num_seqs, device=device)
        exclude = torch.zeros(num_all, dtype=torch.bool, device=device)
        exclude[b.seqs] = b.flags("exclude_special_tokens", False)
        row_local = local[meta.seq_ids]  # [num_tokens]: index among the head's sequences
        # Every row of the head's sequences is weighed, whatever is left out after: the same
        # rows in the same product, so what a request leaves out changes no weight it keeps.
        rows = torch.nonzero(row_local >= 0).squeeze(1)  # [num_rows]
        weights = torch.relu(self.token_weight(b.hidden[rows]).float()).squeeze(1)  # [num_rows]
        ids = meta.input_ids[rows]
        dropped = self.unused[ids] | (exclude[meta.seq_ids[rows]] & self.special[ids])
        # Weights are >= 0, so the zeros `out` starts from, and those of dropped rows, change
        # no maximum.
        out = torch.zeros(b.num_seqs * vocab, dtype=torch.float32, device=device)
        index = row_local[rows] * vocab + ids
        out.scatter_reduce_(0, index, weights.masked_fill(dropped, 0.0), reduce="amax")
        merged = b.merge("weights", out.view(b.num_seqs, vocab), "max")
        return b.final_only(list(merged.cpu().numpy()))


# By sequence method, then by the name a head carries its reduction under: what a cached
# prefix gives it. LAST needs nothing of a prefix; MEAN and MEAN_SQRT_LEN add its plain sum.
# The others (CLS, MAX, WEIGHTED_MEAN) would need its rows: such heads share no prefix.
_PREFIX_CARRY: dict[str, dict[str, tuple[str, ...]]] = {
    "LAST": {"pooled": (), "row": ()},
    "MEAN": {"pooled": ("pooled",), "sum": ("sum",)},
    "MEAN_SQRT_LEN": {"pooled": ("pooled",)},
}


def _not_prompt_first(meta: PoolingMetadata) -> torch.Tensor:  # [num_tokens] bool
    """False at the rows holding a prompt's first token (a chunk that starts a prompt)."""
    keep = torch.ones_like(meta.seq_ids, dtype=torch.bool)
    keep[meta.cu_seqlens[:-1]] = False if meta.starts is None else meta.starts > 0
    return keep


def _token_rows(
    b: HeadBatch, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """`methods.token_rows` for the head's sequences: ALL, or STEP where `step_tag_id` is set."""
    return token_rows(b.meta, b.seqs, [p.step_tag_id for p in b.params], keep)
