"""The keys and values of prompts that run in chunks: device buffers the model runner owns.

A prompt longer than what a step's token budget leaves runs over several steps. From its first
chunk to the moment the engine releases it (finished, failed or cancelled), its keys and values
of every layer stay here, so that each later chunk attends to the whole prompt before it. Only
such prompts have buffers; a prompt that runs whole keeps nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

from vecpool.models.layers.kv_blocks import KVBuffers


class KVCache:
    """`KVBuffers` by request id. Used from the engine's step thread only."""

    def __init__(self) -> None:
        self._buffers: dict[str, KVBuffers] = {}

    def buffers(self, request_id: str, capacity: int) -> KVBuffers:
        """The buffers of `request_id`, made for `capacity` prompt positions at its first
        chunk (device memory is taken layer by layer when the first chunk runs)."""
        buffers = self._buffers.get(request_id)
        if buffers is None:
            buffers = self._buffers[request_id] = KVBuffers(capacity)
        return buffers

    def release(self, request_ids: Iterable[str]) -> None:
        """Free the buffers of these requests (those without any are skipped)."""
        for request_id in request_ids:
            buffers = self._buffers.pop(request_id, None)
            if buffers is not None:
                buffers.free()

    @property
    def num_entries(self) -> int:
        """Requests holding buffers."""
        return len(self._buffers)

    @property
    def num_bytes(self) -> int:
        """Device memory the buffers take."""
        return sum(b.num_bytes for b in self._buffers.values())
