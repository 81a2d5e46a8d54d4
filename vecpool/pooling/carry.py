"""What a head carries from one chunk of a prompt to the next.

A prompt longer than what a step's token budget leaves runs in chunks over several steps. A
head reduces each chunk as it would a whole prompt (a sum, a maximum, a row), and `Carry`
merges that with what the prompt's earlier chunks left, so that the last chunk finishes the
output the whole prompt would have given.
"""

from __future__ import annotations

import torch

from vecpool.pooling.methods import merge_values


class Carry:
    """The accumulators of one head's sequences across the chunks of their prompts.

    The pooling runner owns them: it hands a step's head what each sequence's earlier chunks
    left (`earlier`), and commits what `merge` recorded for the next chunk (`updates`) only
    once the whole step has pooled, so a step that fails leaves them as they were."""

    def __init__(self, earlier: list[dict[str, torch.Tensor] | None], final: list[bool]):
        # [k]: per sequence, what its earlier chunks left, by name; None: its prompt starts here
        self.earlier = earlier
        self.final = final  # [k]: the sequence ends its prompt
        # [k]: what each sequence's next chunk starts from (filled for those that continue)
        self.updates: list[dict[str, torch.Tensor]] = [{} for _ in final]
        self.whole = all(final) and all(e is None for e in earlier)  # nothing to carry

    def merge(self, name: str, values: torch.Tensor, how: str) -> torch.Tensor:
        """`values` (`[k, ...]`, this chunk's, per sequence) merged with what earlier chunks left
        under `name` (`how`: "sum", "max", "first" or "last"; see `methods.merge_values`).
        The result is recorded for sequences whose prompts continue."""
        if self.whole or how == "last":  # the last chunk's values are the answer: keep nothing
            return values
        merged = values
        continuing = [i for i, e in enumerate(self.earlier) if e is not None]
        if continuing:
            rows = torch.tensor(continuing, dtype=torch.int64).to(values.device, non_blocking=True)
            earlier = torch.stack([self._earlier(i, name) for i in continuing])
            merged = values.clone()
            merged[rows] = merge_values(how, earlier, values[rows])
        for i, final in enumerate(self.final):
            if not final:
                self.updates[i][name] = merged[i].clone()
        return merged

    def _earlier(self, i: int, name: str) -> torch.Tensor:
        earlier = self.earlier[i]
        assert earlier is not None and name in earlier, f"no {name!r} carried for sequence {i}"
        return earlier[name]
