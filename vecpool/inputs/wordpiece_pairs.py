"""Text pairs for `vecpool.inputs.wordpiece`: the pair template a tokenizer's post-processor applies,
read off the library by probes, and its longest-first truncation, as array arithmetic over a
batch of pairs whose two texts are already tokenized."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from vecpool.inputs.arrays import TruncationSide


def longest_first(own: np.ndarray, room: int) -> np.ndarray:
    """The tokens kept of each pair's two texts (`own`, `[P, 2]`) within `room` tokens, as the
    library's longest-first truncation keeps them: the shorter text whole and the longer cut
    to the rest, unless the shorter alone takes more than half, when each keeps half (the
    longer one, or the second of equals, the odd token)."""
    short = own.min(axis=1)
    long_kept = np.where(short > room, short, np.maximum(short, room - short))
    both = short + long_kept > room
    short_kept = np.where(both, room // 2, short)
    long_kept = np.where(both, room // 2 + room % 2, long_kept)
    swapped = own[:, 0] > own[:, 1]
    kept = np.stack(
        [np.where(swapped, long_kept, short_kept), np.where(swapped, short_kept, long_kept)], 1
    )
    return np.where((own.sum(axis=1) > room)[:, None], np.minimum(kept, own), own)


@dataclass(frozen=True)
class PairTemplate:
    """The post-processor's special tokens around a pair's two texts and the segment of each
    part: `leading` text `middle` text_pair `trailing`, read off probes (`read_pair_template`)."""

    leading: tuple[int, ...]
    middle: tuple[int, ...]
    trailing: tuple[int, ...]
    # Segment ids of the leading tokens, the text, the middle tokens, the pair, the trailing.
    segments: tuple[int, int, int, int, int]

    @property
    def num_special(self) -> int:
        return len(self.leading) + len(self.middle) + len(self.trailing)

    def join(
        self,
        parts: list[np.ndarray | None],
        max_tokens: int | None,
        side: TruncationSide,
    ) -> list[tuple[np.ndarray, np.ndarray] | None]:
        """Each pair's ids and segment ids from its two texts' own tokens (`parts`: first
        text, second text, of each pair in turn; None where a text is not served, and then its
        pair is None), truncated to `max_tokens` in all, longest text first, from `side`."""
        firsts, seconds = parts[0::2], parts[1::2]
        served = [
            i
            for i, (a, b) in enumerate(zip(firsts, seconds, strict=True))
            if a is not None and b is not None
        ]
        every: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(firsts)
        if not served:
            return every
        rows: list[np.ndarray] = [p for i in served for p in (firsts[i], seconds[i])]  # type: ignore[misc]
        own = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows)).reshape(-1, 2)
        kept = own if max_tokens is None else longest_first(own, max_tokens - self.num_special)
        ids, type_ids = self.assemble(np.concatenate(rows), own, kept, side)
        for i, row in zip(served, zip(ids, type_ids, strict=True), strict=True):
            every[i] = row
        return every

    def assemble(
        self, flat: np.ndarray, own: np.ndarray, kept: np.ndarray, side: TruncationSide
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Each pair's ids and segment ids (views of two buffers) from its texts' tokens, flat
        in order (`own`: `[P, 2]` counts), `kept` of each from `side`."""
        parts = [self.leading, None, self.middle, None, self.trailing]
        # Per pair, the five parts' sizes, and where each part starts in the output.
        sizes = np.empty((own.shape[0], 5), dtype=np.int64)
        for j, part in enumerate(parts):
            sizes[:, j] = len(part) if part is not None else kept[:, j // 2]
        starts = (np.cumsum(sizes.ravel()) - sizes.ravel()).reshape(sizes.shape)
        total = int(sizes.sum())
        ids = np.empty(total, dtype=np.int64)
        type_ids = np.repeat(
            np.tile(np.asarray(self.segments, dtype=np.int64), own.shape[0]), sizes.ravel()
        )
        for j, part in enumerate(parts):
            if part is not None:
                for k, token in enumerate(part):
                    ids[starts[:, j] + k] = token
        # Each kept token's place in `flat`: its text's first kept token, then the next ones.
        text_start = (np.cumsum(own.ravel()) - own.ravel()).reshape(own.shape)
        skip = own - kept if side == "left" else np.zeros_like(own)
        counts = kept.ravel()
        first = np.cumsum(counts) - counts
        source = np.repeat((text_start + skip).ravel() - first, counts) + np.arange(counts.sum())
        target = np.repeat(starts[:, [1, 3]].ravel() - first, counts) + np.arange(counts.sum())
        ids[target] = flat[source]
        bounds = [*starts[:, 0].tolist(), total]
        pairs = list(itertools.pairwise(bounds))
        return [ids[a:b] for a, b in pairs], [type_ids[a:b] for a, b in pairs]


def read_pair_template(tok: Tokenizer, first: str, second: str) -> PairTemplate | None:
    """The pair template the library applies to (`first`, `second`), or None where its
    parts are not where a template would put them, or a part's segment ids differ."""
    full = tok.encode(first, second)
    a = tok.encode(first, add_special_tokens=False).ids
    b = tok.encode(second, add_special_tokens=False).ids
    ids, segments = full.ids, full.type_ids
    at_a = next((i for i in range(len(ids)) if ids[i : i + len(a)] == a), None)
    if at_a is None:
        return None
    after_a = at_a + len(a)
    at_b = next((i for i in range(after_a, len(ids)) if ids[i : i + len(b)] == b), None)
    if at_b is None:
        return None
    bounds = [0, at_a, after_a, at_b, at_b + len(b), len(ids)]
    kinds = []
    for lo, hi in itertools.pairwise(bounds):
        seen = set(segments[lo:hi])
        if len(seen) > 1:
            return None
        kinds.append(seen.pop() if seen else 0)
    return PairTemplate(
        tuple(ids[:at_a]),
        tuple(ids[after_a:at_b]),
        tuple(ids[at_b + len(b) :]),
        tuple(kinds),  # type: ignore[arg-type]
    )
