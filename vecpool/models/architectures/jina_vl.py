"""jina-reranker-m0 (`JinaVLForRanking`): Qwen2-VL read as a cross-encoder of a query against
a text or image document.

As its published definition: the pair is written "**Document**:\\n{document}\\n**Query**:\\n
{query}" (an image side as its placeholder `<|vision_start|><|image_pad|><|vision_end|>`, the
document's images before the query's), tokenized, and the score token (id 100) appended; the
language model's final row at that token goes through `score`, a two-layer MLP (`score.0`,
ReLU, `score.2`) to one logit, less a bias of 2.65; the score is its sigmoid. There is no
language-model head (the checkpoint's `lm_head` is an identity).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from vecpool.config import PairTemplate
from vecpool.models.architectures.decoder import DecoderConfig
from vecpool.models.architectures.qwen2_vl import (
    MRopeRotary,
    Qwen2VLForConditionalGeneration,
    VisionConfig,
)
from vecpool.models.base import Capability

# The published model's constants: its prompt, score token and logit bias.
_TEMPLATE = "**Document**:\n{document}\n**Query**:\n{query}"
_IMAGE_TEXT = "<|vision_start|><|image_pad|><|vision_end|>"
SCORE_TOKEN_ID = 100
LOGIT_BIAS = 2.65


class JinaVLForRanking(Qwen2VLForConditionalGeneration):
    """`visual`, Qwen2's decoder, and `score` on the last token (see the module docstring)."""

    capabilities = frozenset({Capability.SEQUENCE_CLASSIFIER, Capability.IMAGE_TOWER})
    classifier_pooler = "LAST"
    pair_template = PairTemplate(_TEMPLATE, _IMAGE_TEXT, (SCORE_TOKEN_ID,))
    tied_weights: ClassVar[dict[str, str]] = {}
    optional_parameters = ()  # type: ignore[assignment]  # the decoder's is a 1-tuple
    # A checkpoint saved with the generation class's head keeps an `lm_head` it never uses.
    unused_checkpoint_keys: ClassVar[tuple[str, ...]] = ("*.rotary_emb.inv_freq", "lm_head.*")

    def __init__(self, c: DecoderConfig, rotary: MRopeRotary, vision: VisionConfig):
        super().__init__(c, rotary, vision)
        self.lm_head = None
        self.tie_word_embeddings = False
        self.num_labels = 1  # one relevance score, whatever config.json's num_labels says
        self.score = nn.Sequential(
            nn.Linear(c.hidden_size, c.hidden_size), nn.ReLU(), nn.Linear(c.hidden_size, 1)
        )

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """`[n, hidden]` rows at the score token -> `[n, 1]` logits, less the bias (their
        sigmoid is the published score)."""
        return self.score(pooled) - LOGIT_BIAS
