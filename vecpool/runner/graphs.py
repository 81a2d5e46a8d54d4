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
- `seqs`: the sequence slots of the attention metadata, a power of two: at least one per 8
  tokens of the bucket up to 8192 tokens (one key serves most steps of a bucket); in larger
  buckets at least as many as sequences of half `max_len` fill (`_default_slots`); more when
  the step holds more (shorter) sequences. Unused slots are empty sequences (their boundaries
  repeat the last one);
- `max_len`: the longest sequence the attention kernel is launched for, a power of two from 64.

FlashAttention's grid is slots x ceil(max_len / 128) x heads; empty slots cost blocks that
return at once, which is why large buckets keep fewer of them: a step of 32,768 tokens holding
128 passages would keep 2,048 slots at one per 8 tokens (as many as a step may hold sequences),
where 256 serve. The engine records the common keys when it starts (`warm_up`: every token
bucket with `max_len` up to 512); another key is recorded the first time a step needs it (two
forwards and a capture, tens of milliseconds once), up to `max_graphs`; a step whose key cannot
get one runs as before. Prompt embeds and token ids enter the graph the same way,
after the embedding lookup, so they stay bit-exact.

Steps whose prompts read shared cached prefixes (`SharedPrefixes`: an LLM reranker's documents
after their one cached query) get graphs too, when every prompt is whole: the key adds the
prefix's shape (`PrefixShape`: group slots, pool rows read and written, the groups' longest
queries and prefixes, each a power of two), and the step's groups are padded as its sequences
are (empty groups, pool row 0 for the padding keys, a spare padding row for the padding
queries, the last write repeated for the padding writes). Without graphs such a step launches
every layer's kernels from the host, and the host is then its limit.

Graphs are recorded only where every attention call of the forward goes to the varlen kernel
(`AttentionMetadata.static`): a model that needs the padded fallback (logit soft-capping)
refuses to be recorded and runs without graphs; one whose cached attention copies keys (a
sliding window) runs its prefix steps without graphs. Without a CUDA device (`capture=False`)
the same padding and metadata run as plain forwards, which is how the CPU tests check them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from vecpool.models.layers.attention import AttentionMetadata, GraphUnsupported, cached_step
from vecpool.models.layers.kv_blocks import BlockPool, ChunkedKV, PrefixKV, SharedPrefixes

logger = logging.getLogger(__name__)

# The forward a graph records: (x, positions, attention, token types) -> hidden states.
Forward = Callable[
    [torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None], torch.Tensor
]

# Steps up to this many tokens get graphs by default: above it a step's kernels are large
# enough that launching them is a small share of the step. A model under `NARROW_WIDTH` wide
# launches as many kernels for far less work each: its graphs serve steps up to the step
# budget, `NARROW_MAX_TOKENS` at most (`graph_max_tokens`).
DEFAULT_MAX_TOKENS = 8192
NARROW_WIDTH = 1024
NARROW_MAX_TOKENS = 32768
DEFAULT_MAX_GRAPHS = 192  # `warm_up` records up to 123 (32,768 tokens), the rest on first use
_FINE_FROM = 128  # buckets from here go in quarter steps (`token_buckets`)
_MIN_MAX_LEN = 64
_WARM_MAX_LENS = (64, 128, 256, 512)  # the shapes `warm_up` records, with every bucket


def token_buckets(max_tokens: int, fine_from: int = _FINE_FROM) -> list[int]:
    """Flat token counts graphs are recorded for: powers of two from 16 to `fine_from` (128),
    then steps of a quarter of the previous power (a step of 128 tokens or more is padded by
    at most a quarter). Below 128 a forward costs about the same at any size (its weights'
    reads and its launches); above, its rows' work: with `fine_from` 1,024 (as it was), a step
    of 16 queries (~580 tokens) ran as 1,024 on the device (Qwen3-0.6B queries in steps of
    16: 1.08x faster in quarter steps, `ab_buckets_qwen3-0.6b_seqs16_h200.json`)."""
    sizes = [16]
    while sizes[-1] < max_tokens:
        last = sizes[-1]
        power = 1 << (last.bit_length() - 1)
        sizes.append(last * 2 if last < fine_from else last + power // 4)
    return [s for s in sizes if s < max_tokens] + [max_tokens]


def graph_max_tokens(hidden_size: int, step_budget: int | None = None) -> int:
    """The largest step (in tokens) that a model of `hidden_size` replays from graphs: 8192,
    or for a narrow model its step budget up to 32,768 (on an H200, steps of ~500 queries:
    MiniLM +35%, BERT-base +14% against 8192; `gpu_graphs32k_h200.json`)."""
    if hidden_size >= NARROW_WIDTH or step_budget is None:
        return DEFAULT_MAX_TOKENS
    return max(DEFAULT_MAX_TOKENS, min(NARROW_MAX_TOKENS, step_budget))


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class PrefixShape:
    """The padded shape of a step's shared prefixes (`SharedPrefixes`)."""

    groups: int  # group slots
    pool_rows: int  # prefix rows read from the pool, all groups together
    max_q: int  # longest group (its sequences' rows together)
    max_k: int  # longest prefix
    writes: int  # rows whose keys and values the step writes to the pool (0: none)


@dataclass(frozen=True)
class ShapeKey:
    tokens: int  # flat rows
    seqs: int  # sequence slots of the attention metadata
    max_len: int  # longest sequence the attention kernel is launched for
    prefix: PrefixShape | None = None  # a step reading shared prefixes; None: no cache


@dataclass
class _PrefixInputs:
    """The static buffers of one prefix key's graph (its `SharedPrefixes`, padded)."""

    pool: BlockPool
    q_rows: torch.Tensor  # [tokens] int64: padding entries name the spare padding row
    cu_q: torch.Tensor  # [groups + 1] int32
    pool_rows: torch.Tensor  # [pool_rows] int64: padding entries read row 0
    cu_k: torch.Tensor  # [groups + 1] int32
    # Padding entries repeat the last write: the same row to the same place again.
    write_rows: torch.Tensor  # [writes] int64: batch rows written to the pool
    write_pool_rows: torch.Tensor  # [writes] int64: where they go


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: replayed as a plain forward (no CUDA)
    prefix: _PrefixInputs | None = None


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
        output_size: int = 0,  # width of the forward's rows; 0: hidden_size
        max_model_len: int,
        use_varlen: bool,
        with_token_types: bool,
        packed_max_len: int = 0,  # keys whose sequences are at most this long: packed attention
        max_tokens: int = DEFAULT_MAX_TOKENS,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
        capture: bool = True,  # False: no CUDA graphs, the same padding as plain forwards
    ):
        self.forward = forward
        self.buckets = token_buckets(max_tokens)
        self.max_model_len = max_model_len
        self.use_varlen = use_varlen
        self.packed_max_len = packed_max_len
        self.max_graphs = max_graphs
        self.capture = capture
        self.enabled = True  # False once a model refused to be recorded
        self.prefix_enabled = True  # False once its prefix steps refused to be recorded
        rows, slots = self.buckets[-1], _pow2_at_least(max_seqs + 1)
        self.max_seqs = slots - 1  # one slot stays free for the padding rows
        self.x = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
        # Every graph ends by copying its hidden states here: one output buffer for all of them
        # (each graph's own intermediates return to the shared pool once it is recorded).
        self.out = torch.zeros(rows, output_size or hidden_size, dtype=dtype, device=device)
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
        length = max(length, max_len)
        seqs = max(_pow2_at_least(num_seqs + 1), self._default_slots(tokens, length))
        return ShapeKey(tokens, seqs, length)

    def _default_slots(self, tokens: int, max_len: int) -> int:
        """The fewest sequence slots of a key: one per 8 tokens up to `DEFAULT_MAX_TOKENS`;
        above, enough for sequences of half `max_len` (and one more for the padding rows)."""
        wanted = tokens // 8 if tokens <= DEFAULT_MAX_TOKENS else 2 * tokens // max_len + 1
        return min(self.max_seqs + 1, max(2, _pow2_at_least(wanted)))

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Record the graphs of the common shapes now, so that no step waits for one later:
        every token bucket, with sequences up to 512 tokens long (those the model allows)."""
        for tokens in self.buckets:
            for max_len in _WARM_MAX_LENS:
                if max_len > max(tokens, _MIN_MAX_LEN) or max_len > self.max_model_len:
                    continue
                key = ShapeKey(tokens, self._default_slots(tokens, max_len), max_len)
                if key in self.graphs or len(self.graphs) >= self.max_graphs:
                    continue
                self._fill_dummy(key)
                if not self._record(key, _Graph(None)):
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
        if not self.enabled or attn.key_rows is not None:
            return None
        shared = None
        if attn.kv is not None:
            shared = self._pool_readers(attn.kv)
            if shared is None:
                return None
        n, s = x.shape[0], attn.num_seqs
        # A prefix step keeps one padding row at least: its padding queries write there.
        key = self.key(n + (shared is not None), s, attn.max_seqlen)
        if key is None:
            return None
        if shared is not None:
            assert attn.kv is not None and attn.kv.prefix is not None
            writes = attn.kv.prefix.write_rows.shape[0]
            # Only the step's own sequence slots: prefix keys are fewer than plain ones, and
            # each empty slot costs the attention kernel blocks of its grid.
            key = replace(key, seqs=_pow2_at_least(s + 1), prefix=_prefix_shape(shared, writes))
        entry = self.graphs.get(key)
        if entry is None:
            if len(self.graphs) >= self.max_graphs:
                return None
            entry = _Graph(None, self._prefix_inputs(key, attn.kv) if shared else None)
            self._fill(key, entry, x, positions, attn, token_types)
            if not self._record(key, entry):
                return None
        self._fill(key, entry, x, positions, attn, token_types)
        if entry.graph is not None:
            entry.graph.replay()
        else:
            try:
                self._forward(key, entry)
            except GraphUnsupported:  # without CUDA, found here rather than when recording
                del self.graphs[key]
                self.prefix_enabled = False
                return None
        self.replays += 1
        return self.out[:n].clone()  # the next step writes the same buffer

    def _pool_readers(self, kv: ChunkedKV) -> SharedPrefixes | None:
        """The step's shared prefixes when a graph can serve it: whole prompts (no earlier
        chunks, none kept for later ones) that read the pool (and may write blocks to it)."""
        prefix = kv.prefix
        if not self.prefix_enabled or prefix is None or prefix.shared is None:
            return None
        if prefix.shared.own_key_rows is not None:
            return None
        if any(b is not None for b in kv.buffers):
            return None
        return prefix.shared

    def _prefix_inputs(self, key: ShapeKey, kv: ChunkedKV | None) -> _PrefixInputs:
        assert key.prefix is not None and kv is not None and kv.prefix is not None
        device, shape = self.x.device, key.prefix
        return _PrefixInputs(
            pool=kv.prefix.pool,
            q_rows=torch.zeros(key.tokens, dtype=torch.int64, device=device),
            cu_q=torch.zeros(shape.groups + 1, dtype=torch.int32, device=device),
            pool_rows=torch.zeros(shape.pool_rows, dtype=torch.int64, device=device),
            cu_k=torch.zeros(shape.groups + 1, dtype=torch.int32, device=device),
            write_rows=torch.zeros(shape.writes, dtype=torch.int64, device=device),
            write_pool_rows=torch.zeros(shape.writes, dtype=torch.int64, device=device),
        )

    def _fill(
        self,
        key: ShapeKey,
        entry: _Graph,
        x: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        token_types: torch.Tensor | None,
    ) -> None:
        """Copy a step into the static buffers, laid out for `key` (device copies only)."""
        n, s, rows = x.shape[0], attn.num_seqs, key.tokens
        self.x[:n].copy_(x)
        # The padding rows zeroed: compiled decoder layers overwrite their input with the
        # attention's residual sum (`layers.add_linear`), padding rows too, whose attention
        # output no kernel defines; zeroed, no step sees what an earlier one left there.
        self.x[n:rows].zero_()
        self.positions[:n].copy_(positions)
        if self.token_types is not None and token_types is not None:
            self.token_types[:n].copy_(token_types)
        self.cu_seqlens[: s + 1].copy_(attn.cu_seqlens)
        self.cu_seqlens[s + 1 :].fill_(n)  # empty sequences after the step's own
        inputs = entry.prefix
        if not self.capture or inputs is not None:
            # Each row's place: read by the padded fallback (no CUDA), which places the padding
            # rows in the first free slot (no query of the step reads it), and by the keys of
            # a prefix step. A recorded graph without prefixes runs the varlen kernel only
            # (`AttentionMetadata.static`), which reads `cu_seqlens`: four copies a step saved.
            self.seq_ids[:n].copy_(attn.seq_ids)
            self.seq_ids[n:rows].fill_(s)
            self.pos_in_seq[:n].copy_(attn.pos_in_seq)
            torch.remainder(self._arange[: rows - n], key.max_len, out=self.pos_in_seq[n:rows])
        if inputs is not None:
            assert attn.kv is not None and attn.kv.prefix is not None
            prefix = attn.kv.prefix
            shared = prefix.shared
            assert shared is not None
            m, g, p = shared.q_rows.shape[0], shared.cu_q.shape[0] - 1, shared.pool_rows.shape[0]
            inputs.q_rows[:m].copy_(shared.q_rows)
            inputs.q_rows[m:].fill_(n)  # padding queries: the first padding row
            inputs.cu_q[: g + 1].copy_(shared.cu_q)
            inputs.cu_q[g + 1 :].fill_(m)  # empty groups after the step's own
            inputs.pool_rows[:p].copy_(shared.pool_rows)
            inputs.pool_rows[p:].fill_(0)
            inputs.cu_k[: g + 1].copy_(shared.cu_k)
            inputs.cu_k[g + 1 :].fill_(p)
            w = prefix.write_rows.shape[0]
            if w:
                inputs.write_rows[:w].copy_(prefix.write_rows)
                inputs.write_rows[w:].copy_(prefix.write_rows[-1])
                inputs.write_pool_rows[:w].copy_(prefix.write_pool_rows)
                inputs.write_pool_rows[w:].copy_(prefix.write_pool_rows[-1])

    def _metadata(self, key: ShapeKey, entry: _Graph) -> AttentionMetadata:
        cu = self.cu_seqlens[: key.seqs + 1]
        seq_ids, pos_in_seq = self.seq_ids[: key.tokens], self.pos_in_seq[: key.tokens]
        kv = None
        inputs = entry.prefix
        if inputs is not None and key.prefix is not None:  # a step reading shared prefixes
            none = torch.zeros(0, dtype=torch.int64, device=cu.device)
            shared = SharedPrefixes(
                q_rows=inputs.q_rows,
                cu_q=inputs.cu_q,
                max_q=key.prefix.max_q,
                pool_rows=inputs.pool_rows,
                cu_k=inputs.cu_k,
                max_k=key.prefix.max_k,
                own_cu_k=cu,  # whole prompts: each attends to its own rows after its prefix
                own_max_k=key.max_len,
                own_num_keys=key.tokens,
                own_key_rows=None,
                own_key_starts=[],
            )
            prefix = PrefixKV(
                pool=inputs.pool,
                write_rows=inputs.write_rows,
                write_pool_rows=inputs.write_pool_rows,
                write_slots=none,  # the rest serves the copying layout, which graphs refuse
                read_pool_rows=none,
                read_key_rows=none,
                read_slots=none,
                read_blocks=none,
                own_key_rows=none,
                num_keys=key.tokens,
                prefix_tokens=[],
                key_starts=[],
            )
            prefix.shared, prefix.shared_only = shared, True
            kv = ChunkedKV([], [], [], [], cu, key.max_len, seq_ids, pos_in_seq, prefix)
        return AttentionMetadata(
            cu_seqlens=cu,
            max_seqlen=key.max_len,
            seq_ids=seq_ids,
            pos_in_seq=pos_in_seq,
            use_varlen=self.use_varlen,
            kv=kv,
            static=self.capture,
            packed=key.max_len <= self.packed_max_len,
        )

    def _forward(self, key: ShapeKey, entry: _Graph) -> None:
        """The forward of `key`'s rows, its hidden states left in `out`."""
        rows = key.tokens
        types = self.token_types[:rows] if self.token_types is not None else None
        meta = self._metadata(key, entry)
        with cached_step(meta) if meta.kv is not None else contextlib.nullcontext():
            hidden = self.forward(self.x[:rows], self.positions[:rows], meta, types)
        self.out[:rows].copy_(hidden)

    def _record(self, key: ShapeKey, entry: _Graph) -> bool:
        """Record the graph of `key` into `entry` (the buffers hold a valid step); False if
        the model cannot be recorded, which turns graphs off for it (for its prefix steps
        only, when the step was one)."""
        if self.capture:
            try:
                # On a stream of the model's device: torch's default capture stream is made
                # once per process, on whichever device was current then (another engine's).
                # The engine makes the model's device current around its steps and warm-up
                # (`ModelRunner.on_device`), as the kernels launched here need.
                device = self.x.device
                stream = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    self._forward(key, entry)  # a first run: library handles, workspaces
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(
                    graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"
                ):
                    self._forward(key, entry)
            except Exception as exc:  # a forward that cannot be recorded still runs without
                off = "CUDA graphs are off"
                if key.prefix is not None:
                    off += " for steps reading cached prefixes"
                if isinstance(exc, GraphUnsupported):
                    logger.info("%s for this model: %s", off, exc)
                else:
                    logger.warning("%s: recording a step failed: %s", off, exc)
                if key.prefix is not None:
                    self.prefix_enabled = False
                else:
                    self.enabled = False
                return False
            entry.graph = graph
        self.graphs[key] = entry
        return True


def _prefix_shape(shared: SharedPrefixes, writes: int) -> PrefixShape:
    return PrefixShape(
        groups=_pow2_at_least(shared.cu_q.shape[0]),  # the step's groups and one more at least
        pool_rows=_pow2_at_least(shared.pool_rows.shape[0]),
        max_q=max(_pow2_at_least(shared.max_q), _MIN_MAX_LEN),
        max_k=max(_pow2_at_least(shared.max_k), _MIN_MAX_LEN),
        writes=_pow2_at_least(writes) if writes else 0,
    )
