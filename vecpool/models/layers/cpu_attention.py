"""Attention of a flat batch on the CPU without the padding tax.

The exact fallback (`attention._padded_attention`) lays every sequence of a step out at the
step's longest length: a step of one 256-token passage and a hundred 20-token queries computes
101 x 256 x 256 logits per head where its sequences need 256^2 + 100 x 20^2, seven times
fewer. Two other ways run the same attention at what the tokens cost:

- **buckets** (`bucketed_attention`): the sequences sorted by length and grouped (`plan_buckets`)
  so that each group, padded to its own longest sequence, wastes little; one `[n, L, heads,
  head_dim]` gather of the fused q/k/v rows and one `scaled_dot_product_attention` per group,
  a key mask only in a group whose lengths differ (causal attention needs none: a padded key
  comes after every real query), and one gather of the output rows back into the flat order.
- **sequences** (`sequence_attention`): each sequence on its own, reading its rows of the flat
  batch in place (no copy in), one call per sequence.

Which one a machine runs is measured when an engine loads (`vecpool.runner.cpu_choice`): per
call cost against per logit cost differs by CPU. Both compute each real query row from its own
sequence's keys only, with torch's CPU attention kernel, float32 within an ulp or so of the
padded layout (the kernel's blocking follows the padded length).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# How the CPU runs a step's plain attention (`AttentionMetadata.cpu_attention`).
CPU_ATTENTION_MODES = ("padded", "buckets", "sequences")

# One more group costs about as much as this many (query, key) logits of one head more: the
# call, the gather of its rows and the kernel's set-up (about 10 us against 1.5 ns a logit on
# a quiet Xeon core, float32). Groups are only formed where they save more than that. An
# engine measures its own (`cpu_choice`): threads waiting on each other on a busy machine
# make a call cost many times more.
GROUP_COST_LOGITS = 8192


@dataclass
class BucketPlan:
    """A step's sequences grouped by length: built once per step, read by every layer."""

    shapes: list[tuple[int, int]]  # (sequences, padded length) of each group
    gather: list[torch.Tensor]  # per group [n * L] int64: the flat row of each slot
    key_masks: list[torch.Tensor | None]  # per group [n, 1, 1, L] bool; None: lengths equal
    scatter: torch.Tensor  # [num_tokens] int64: each flat row's slot among the groups' slots


def plan_buckets(lengths: np.ndarray, group_cost: float = GROUP_COST_LOGITS) -> list[np.ndarray]:
    """The sequences (indices into `lengths`) of each group, groups of ascending length.

    The grouping is the cheapest partition of the sequences sorted by length into runs, a run
    costing `count * longest^2 + group_cost` (logits of its padded layout plus a group's fixed
    cost): found exactly over the distinct lengths by dynamic programming, O(distinct^2)."""
    order = np.argsort(lengths, kind="stable")
    distinct, counts = np.unique(lengths[order], return_counts=True)
    before = np.concatenate([[0], np.cumsum(counts)])  # sequences shorter than distinct[j]
    best = np.zeros(len(distinct) + 1)  # best[j]: cost of the first j distinct lengths
    cut = np.zeros(len(distinct) + 1, dtype=np.int64)
    for j in range(1, len(distinct) + 1):
        longest = float(distinct[j - 1]) ** 2
        costs = best[:j] + (before[j] - before[:j]) * longest + group_cost
        cut[j] = int(np.argmin(costs))
        best[j] = costs[cut[j]]
    groups: list[np.ndarray] = []
    j = len(distinct)
    while j > 0:
        groups.append(order[before[cut[j]] : before[j]])
        j = int(cut[j])
    return groups[::-1]


def bucket_plan(
    cu_seqlens: np.ndarray,  # [num_seqs + 1] int64
    device: torch.device,
    group_cost: float = GROUP_COST_LOGITS,
) -> BucketPlan:
    """The gathers that lay each group of `plan_buckets` out padded, and the one back."""
    starts, lengths = cu_seqlens[:-1], np.diff(cu_seqlens)
    shapes, gather, key_masks, slots = [], [], [], []
    offset = 0
    for seqs in plan_buckets(lengths, group_cost):
        n, longest = len(seqs), int(lengths[seqs].max())
        pos = np.arange(longest)[None, :]  # [1, L]
        real = pos < lengths[seqs][:, None]  # [n, L]
        # Padding slots read their sequence's first row: finite values, never attended to.
        rows = starts[seqs][:, None] + np.where(real, pos, 0)  # [n, L]
        shapes.append((n, longest))
        gather.append(torch.from_numpy(rows.reshape(-1)).to(device))
        uniform = bool(real.all())
        key_masks.append(None if uniform else torch.from_numpy(real[:, None, None, :]).to(device))
        slot = np.empty((n, longest), dtype=np.int64)  # flat row -> slot, real rows only
        slot[:] = offset + np.arange(n * longest).reshape(n, longest)
        slots.append((rows[real], slot[real]))
        offset += n * longest
    scatter = np.empty(int(cu_seqlens[-1]), dtype=np.int64)
    for rows, slot in slots:
        scatter[rows] = slot
    return BucketPlan(shapes, gather, key_masks, torch.from_numpy(scatter).to(device))


def bucketed_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    plan: BucketPlan,
    *,
    causal: bool,
    scale: float,
) -> torch.Tensor:  # [num_tokens, heads, head_dim]
    """Each group of `plan` attended to in its own padded layout."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    joint = joint_rows(q, k, v)
    outs = []
    for (n, length), rows, key_mask in zip(plan.shapes, plan.gather, plan.key_masks, strict=True):
        if joint is not None:  # one gather moves q, k and v: they are its heads in order
            qkv = joint.index_select(0, rows).view(n, length, heads + 2 * kv_heads, dim)
            qb, kb, vb = qkv.transpose(1, 2).split([heads, kv_heads, kv_heads], dim=1)
        else:
            qb, kb, vb = (
                t.index_select(0, rows).view(n, length, t.shape[1], dim).transpose(1, 2)
                for t in (q, k, v)
            )
        out = F.scaled_dot_product_attention(
            qb,
            kb,
            vb,
            attn_mask=None if causal else key_mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=kv_heads != heads,
        )  # [n, heads, L, D]
        outs.append(out.transpose(1, 2).reshape(n * length, heads, dim))
    return torch.cat(outs).index_select(0, plan.scatter)


def sequence_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    bounds: list[int],  # [num_seqs + 1]: where each sequence starts, then the end
    *,
    causal: bool,
    scale: float,
) -> torch.Tensor:  # [num_tokens, heads, head_dim]
    """Each sequence attended to on its own, its rows read in place."""
    gqa = k.shape[1] != q.shape[1]
    outs = [
        F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1),
            k[s:e].transpose(0, 1),
            v[s:e].transpose(0, 1),
            is_causal=causal,
            scale=scale,
            enable_gqa=gqa,
        ).transpose(0, 1)  # [L, heads, D]
        for s, e in itertools.pairwise(bounds)
    ]
    return torch.cat(outs) if outs else q.new_empty(q.shape)


def joint_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """`[num_tokens, width]`: the rows of which `q`, `k` and `v` (`[num_tokens, heads, D]`
    each) are consecutive column blocks, as a fused q/k/v projection's output split into heads
    is; None when they are not. Copying these rows once into a padded layout is several times
    faster on the CPU than copying three strided views of them."""
    if torch.compiler.is_compiling():
        return None
    head_dim, item = q.shape[2], q.element_size()
    width = (q.shape[1] + 2 * k.shape[1]) * head_dim
    if not (
        q.shape[0] == k.shape[0] == v.shape[0]
        and k.shape[1:] == v.shape[1:]
        and k.shape[2] == head_dim
        and all(t.stride() == (width, head_dim, 1) for t in (q, k, v))
        and q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
        and q.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
        and k.data_ptr() == q.data_ptr() + q.shape[1] * head_dim * item
        and v.data_ptr() == k.data_ptr() + k.shape[1] * head_dim * item
    ):
        return None
    return q.as_strided((q.shape[0], width), (width, 1))
