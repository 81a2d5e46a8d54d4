"""CUDA graphs for small steps: one launch instead of hundreds.

A step of a few dozen queries costs the device a few milliseconds but the host ~20 ms on a
28-layer model: every layer launches a dozen kernels, and each launch, with the Python and
dispatch around it, costs more than the kernel it launches. Online traffic is made of such
steps. A CUDA graph records the launches of one forward once and replays them with one call.

A graph is recorded for fixed shapes, so a step is padded up to a *shape key*:

- `tokens`: the flat token count, rounded up to a bucket (`token_buckets`); the padding rows
  belong to no sequence. Nothing reads across rows but attention, which reads only the rows of
  each sequence's own range, so the padding rows compute garbage that nobody reads, and the
  real rows are what they would be at that row count;
- `seqs`: the sequence slots of the attention metadata: one per 8 tokens of the bucket (a
  power of two), more when the step holds more (shorter) sequences; unused slots are empty sequences
  (their boundaries repeat the last one);
- `max_len`: the longest sequence the attention kernel is launched for, a power of two from 64.

FlashAttention's grid is slots x ceil(max_len / 128) x heads; empty slots cost a block each
that returns at once. The engine records the common keys when it starts (`warm_up`: every
token bucket with `max_len` up to 512); another key is recorded the first time a step needs
it (two forwards and a capture, tens of milliseconds once), up to `max_graphs`; a step whose
key cannot get one runs as before. Prompt embeds and token ids enter the graph the same way,
after the embedding lookup, so they stay bit-exact.

Graphs are recorded only where every attention call of the forward goes to the varlen kernel
(`AttentionMetadata.static`): a model that needs the padded fallback (logit soft-capping)
refuses to be recorded and runs without graphs. Without a CUDA device (`capture=False`) the
same padding and metadata run as plain forwards, which is how the CPU tests check them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vecpool.models.attention import AttentionMetadata, GraphUnsupported

logger = logging.getLogger(__name__)

# The forward a graph records: (x, positions, attention, token types) -> hidden states.
Forward = Callable[
    [torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None], torch.Tensor
]

# Steps up to this many tokens get graphs by default: above it a step's kernels are large
# enough that launching them is a small share of the step.
DEFAULT_MAX_TOKENS = 8192
DEFAULT_MAX_GRAPHS = 96
_MIN_MAX_LEN = 64
_WARM_MAX_LENS = (64, 128, 256, 512)  # the shapes `warm_up` records, with every bucket


def token_buckets(max_tokens: int) -> list[int]:
    """Flat token counts graphs are recorded for: powers of two from 16 to 1024, then steps of
    a quarter of the previous power (a large step is padded by at most a quarter)."""
    sizes = [16]
    while sizes[-1] < max_tokens:
        last = sizes[-1]
        power = 1 << (last.bit_length() - 1)
        sizes.append(last * 2 if last < 1024 else last + power // 4)
    return [s for s in sizes if s < max_tokens] + [max_tokens]


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class ShapeKey:
    tokens: int  # flat rows
    seqs: int  # sequence slots of the attention metadata
    max_len: int  # longest sequence the attention kernel is launched for


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: replayed as a plain forward (no CUDA)


class StepGraphs:
    """The recorded forwards of one model, and the static buffers they read."""

    def __init__(
        self,
        forward: Forward,
        *,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_seqs: int,  # sequences one step may hold
        max_model_len: int,
        use_varlen: bool,
        with_token_types: bool,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
        capture: bool = True,  # False: no CUDA graphs, the same padding as plain forwards
    ):
        self.forward = forward
        self.buckets = token_buckets(max_tokens)
        self.max_model_len = max_model_len
        self.use_varlen = use_varlen
        self.max_graphs = max_graphs
        self.capture = capture
        self.enabled = True  # False once a model refused to be recorded
        rows, slots = self.buckets[-1], _pow2_at_least(max_seqs + 1)
        self.max_seqs = slots - 1  # one slot stays free for the padding rows
        self.x = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
        # Every graph ends by copying its hidden states here: one output buffer for all of them
        # (each graph's own intermediates return to the shared pool once it is recorded).
        self.out = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.token_types = (
            torch.zeros(rows, dtype=torch.int64, device=device) if with_token_types else None
        )
        self.cu_seqlens = torch.zeros(slots + 1, dtype=torch.int32, device=device)
        self.seq_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.pos_in_seq = torch.zeros(rows, dtype=torch.int64, device=device)
        self._arange = torch.arange(rows, dtype=torch.int64, device=device)
        self.graphs: dict[ShapeKey, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0  # steps served by a graph (for tests and metrics)

    def key(self, num_tokens: int, num_seqs: int, max_len: int) -> ShapeKey | None:
        """The shape a step is padded to; None when it is too large for a graph."""
        if num_tokens > self.buckets[-1] or num_seqs > self.max_seqs:
            return None
        tokens = next(b for b in self.buckets if b >= num_tokens)
        length = min(max(_pow2_at_least(max_len), _MIN_MAX_LEN), self.max_model_len)
        seqs = max(_pow2_at_least(num_seqs + 1), self._default_slots(tokens))
        return ShapeKey(tokens, seqs, max(length, max_len))

    def _default_slots(self, tokens: int) -> int:
        return min(self.max_seqs + 1, max(2, _pow2_at_least(tokens // 8)))

    def warm_up(self) -> None:
        """Record the graphs of the common shapes now, so that no step waits for one later:
        every token bucket, with sequences up to 512 tokens long (those the model allows)."""
        for tokens in self.buckets:
            for max_len in _WARM_MAX_LENS:
                if max_len > max(tokens, _MIN_MAX_LEN) or max_len > self.max_model_len:
                    continue
                key = ShapeKey(tokens, self._default_slots(tokens), max_len)
                if key in self.graphs or len(self.graphs) >= self.max_graphs:
                    continue
                self._fill_dummy(key)
                if self._record(key) is None:
                    return

    def _fill_dummy(self, key: ShapeKey) -> None:
        """A valid step of `key`'s shape: one sequence as long as the key allows."""
        length = min(key.tokens, key.max_len)
        self.cu_seqlens[0] = 0
        self.cu_seqlens[1:].fill_(length)
        self.positions[: key.tokens].zero_()
        self.seq_ids[: key.tokens].zero_()
        self.pos_in_seq[: key.tokens].copy_(self._arange[: key.tokens])
        self.pos_in_seq[: key.tokens].remainder_(key.max_len)

    def run(
        self,
        x: torch.Tensor,  # [n, hidden]: the step's input rows (after the embedding lookup)
        positions: torch.Tensor,  # [n]
        attn: AttentionMetadata,
        token_types: torch.Tensor | None,  # [n]
    ) -> torch.Tensor | None:
        """The step's hidden states `[n, hidden]` from a graph; None when it gets none."""
        if not self.enabled or attn.kv is not None or attn.key_rows is not None:
            return None
        n, s = x.shape[0], attn.num_seqs
        key = self.key(n, s, attn.max_seqlen)
        if key is None:
            return None
        entry = self.graphs.get(key)
        if entry is None:
            if len(self.graphs) >= self.max_graphs:
                return None
            self._fill(key, x, positions, attn, token_types)
            entry = self._record(key)
            if entry is None:
                return None
        self._fill(key, x, positions, attn, token_types)
        if entry.graph is not None:
            entry.graph.replay()
        else:
            self._forward(key)
        self.replays += 1
        return self.out[:n].clone()  # the next step writes the same buffer

    def _fill(
        self,
        key: ShapeKey,
        x: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        token_types: torch.Tensor | None,
    ) -> None:
        """Copy a step into the static buffers, laid out for `key` (device copies only)."""
        n, s, rows = x.shape[0], attn.num_seqs, key.tokens
        self.x[:n].copy_(x)
        self.positions[:n].copy_(positions)
        if self.token_types is not None and token_types is not None:
            self.token_types[:n].copy_(token_types)
        self.cu_seqlens[: s + 1].copy_(attn.cu_seqlens)
        self.cu_seqlens[s + 1 :].fill_(n)  # empty sequences after the step's own
        # The padded fallback (no CUDA) places every row: the padding rows in the first free
        # slot, which no query of the step reads.
        self.seq_ids[:n].copy_(attn.seq_ids)
        self.seq_ids[n:rows].fill_(s)
        self.pos_in_seq[:n].copy_(attn.pos_in_seq)
        torch.remainder(self._arange[: rows - n], key.max_len, out=self.pos_in_seq[n:rows])

    def _metadata(self, key: ShapeKey) -> AttentionMetadata:
        return AttentionMetadata(
            cu_seqlens=self.cu_seqlens[: key.seqs + 1],
            max_seqlen=key.max_len,
            seq_ids=self.seq_ids[: key.tokens],
            pos_in_seq=self.pos_in_seq[: key.tokens],
            use_varlen=self.use_varlen,
            static=self.capture,
        )

    def _forward(self, key: ShapeKey) -> None:
        """The forward of `key`'s rows, its hidden states left in `out`."""
        rows = key.tokens
        types = self.token_types[:rows] if self.token_types is not None else None
        hidden = self.forward(self.x[:rows], self.positions[:rows], self._metadata(key), types)
        self.out[:rows].copy_(hidden)

    def _record(self, key: ShapeKey) -> _Graph | None:
        """Record the graph of `key` (the buffers hold a valid step); None if the model
        cannot be recorded, which turns graphs off for it."""
        if not self.capture:
            entry = _Graph(None)
            self.graphs[key] = entry
            return entry
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(key)  # first run of this shape: library handles, workspaces
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self._forward(key)
        except GraphUnsupported as exc:
            logger.info("CUDA graphs are off for this model: %s", exc)
            self.enabled = False
            return None
        except Exception as exc:  # a forward that cannot be recorded still runs without one
            logger.warning("CUDA graphs are off: recording a step failed: %s", exc)
            self.enabled = False
            return None
        entry = _Graph(graph)
        self.graphs[key] = entry
        return entry
