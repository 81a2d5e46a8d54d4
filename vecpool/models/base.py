"""The interface every architecture implements. Models know nothing of requests.

`forward` returns final hidden states; a checkpoint's heads (classifiers, language-model heads,
projections) are separate methods that the pooling runner applies to the rows it selected, so
one model serves several tasks in one batch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from vecpool.config import ListwiseRerankerConfig, PairTemplate
from vecpool.models.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from vecpool.inputs.pixels import PixelTable
    from vecpool.models.loading.folder import ModelFolder


class Capability(enum.Enum):
    """A head function a checkpoint has besides its hidden states (the methods below)."""

    SEQUENCE_CLASSIFIER = "sequence_classifier"  # `classify`
    TOKEN_CLASSIFIER = "token_classifier"  # `classify_tokens`
    MASKED_LM = "masked_lm"  # `compute_logits`
    CAUSAL_LM = "causal_lm"  # `compute_logits`
    TOKEN_PROJECTION = "token_projection"  # `project_tokens`
    LISTWISE_RANKER = "listwise_ranker"  # `project_listwise`: a listwise reranker's vectors
    # `forward(..., images=...)`: a dual encoder's image side, or a vision-language model's
    # vision tower
    IMAGE_TOWER = "image_tower"


@dataclass
class ImageBatch:
    """The images of one step, flat: every image's patch rows concatenated, as a flat batch
    concatenates texts' tokens. Built by the model runner; read by a model with an image tower.

    A dual encoder (CLIP, SigLIP) gives each image one row of the step's flat batch: its
    forward writes the image's pooled, projected embedding there (`rows`). A vision-language
    model (Qwen2-VL) gives each image the rows of its placeholder tokens: the model runner
    writes its `vision_rows` there, into the input embeddings, before the language model."""

    # [num_patches, patch_dim] model dtype. As the flat batch builds it, until the model
    # runner's lookup: float32 rows, or with `table` the [num_patches, code_dim] uint8 codes.
    pixel_values: torch.Tensor
    cu_patches: torch.Tensor  # [num_images + 1] int32: where each image's patches start
    max_patches: int  # the most patches of one image
    grids: list[tuple[int, int]]  # [num_images] (rows, columns) of patches
    # [num_images] int64: the flat batch row each image's output goes to; empty for a
    # vision-language model's images, whose rows the model runner places (a chunk may hold
    # part of an image's placeholders)
    rows: torch.Tensor
    # What turns `pixel_values`' codes into rows; None once the model runner has (or for
    # float rows). A model never sees it set.
    table: PixelTable | None = None

    @property
    def num_images(self) -> int:
        return len(self.grids)


class PoolingModel(nn.Module):
    """A transformer that maps a flat batch of input embeddings to hidden states.

    Subclasses keep Hugging Face's submodule names so that checkpoint names map directly, and
    set the class attributes below that describe how their checkpoints are laid out.
    """

    # The base-model prefix of transformers' *For* classes ("bert.", "roberta.", "model."). As
    # transformers does, a checkpoint key loads with or without it; and a model without heads
    # leaves out a prefixed checkpoint's tensors outside the prefix (the head of the class it
    # was saved from).
    checkpoint_prefixes: ClassVar[tuple[str, ...]] = ()
    # Legacy name endings transformers renames on load: {old ending: new ending}.
    checkpoint_renames: ClassVar[dict[str, str]] = {}
    # Checkpoint entries we knowingly leave unused: glob patterns (after prefix removal).
    unused_checkpoint_keys: ClassVar[tuple[str, ...]] = ()
    # {parameter: the parameter it shares}, transformers' `_tied_weights_keys`, in force when
    # `tie_word_embeddings` is set. As there, a pair the checkpoint holds one of shares that
    # one, and a pair it holds both of stays two parameters unless the two are equal.
    tied_weights: ClassVar[dict[str, str]] = {}
    tie_word_embeddings: bool = False  # from the config
    # Head parameters that a checkpoint in the base model's layout (no key carries a prefix)
    # may lack: the folder is the base model under a head's architecture name, as
    # Qwen3-Embedding-8B ships. The loader calls `drop_parameter` for each one missing.
    optional_parameters: ClassVar[tuple[str, ...]] = ()
    # Checkpoint tensors whose shapes `from_hf_config` reads, for configs that do not state
    # them (ColBERT's projection size): the loader passes them as `hf["checkpoint_shapes"]`.
    shape_keys: ClassVar[tuple[str, ...]] = ()
    # Who implements the architecture: "vecpool" (a native class, filled by the strict
    # loader) or "transformers" (the fallback, which loads itself through `from_folder`).
    implementation: ClassVar[str] = "vecpool"
    # False: every prompt runs whole in one plain forward (no chunked prefill, CUDA graphs or
    # compiled layers), as the transformers fallback's padded forward needs.
    step_optimizations: ClassVar[bool] = True

    hidden_size: int
    vocab_size: int
    max_positions: int  # the longest sequence the position scheme supports
    is_causal: bool
    uses_token_type_ids: bool = False
    capabilities: frozenset[Capability] = frozenset()  # the head methods this model has
    num_labels: int = 0  # outputs of the classifiers
    # What the sequence classifier reads: the "CLS" or "LAST" row, or the "MEAN" of the rows
    classifier_pooler: str = "CLS"
    projection_dim: int = 0  # output size of `project_tokens`, when the model has it
    # Token prompts shorter than this are padded with `pad_token_id` to it at the input stage,
    # as the model was trained (SigLIP's texts: 64 tokens, pooled at the last); 0: none.
    pad_prompts_to: int = 0
    pad_token_id: int = 0
    # Width of the rows `forward` returns, where it differs from `hidden_size` (the width of
    # its input embeddings): a dual encoder's shared space. 0: `hidden_size`.
    output_size: int = 0
    # A dual encoder's image input: the image processor its folder names, the patch size.
    image_patch_dim: int = 0  # channels * patch_size**2 of one patch row; 0: no image tower
    image_grid: tuple[int, int] | None = None  # the one grid of patches it takes; None: any
    # A listwise reranker's prompt format and marker tokens (with `LISTWISE_RANKER`).
    listwise_reranker: ClassVar[ListwiseRerankerConfig | None] = None
    # A cross-encoder that reads each pair as one written prompt (with `SEQUENCE_CLASSIFIER`):
    # how its pairs are written, in place of the tokenizer's pair template.
    pair_template: ClassVar[PairTemplate | None] = None

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        """Build the (empty) module from a Hugging Face `config.json` dict."""
        raise NotImplementedError

    @classmethod
    def from_folder(
        cls, folder: ModelFolder, device: torch.device, dtype: torch.dtype
    ) -> PoolingModel:
        """Build the model and load its weights from a `ModelFolder` (implementations other
        than "vecpool" only)."""
        raise NotImplementedError

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`[num_tokens]` ids -> `[num_tokens, hidden]`: the lookup that prompt embeds replace."""
        raise NotImplementedError

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens] int64
        attn: AttentionMetadata,
        token_type_ids: torch.Tensor | None = None,  # [num_tokens] int64, encoders only
    ) -> torch.Tensor:  # [num_tokens, hidden] final hidden states
        """A model with `Capability.IMAGE_TOWER` also takes `images: ImageBatch | None`: a
        dual encoder returns `[num_tokens, output_size]` rows in its shared space, a
        vision-language model fills its images' placeholder rows (see `ImageBatch`). A model
        with multimodal rotary positions (M-RoPE) may get `[3, num_tokens]` positions."""
        raise NotImplementedError

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """`[n, hidden]` pooled rows -> `[n, num_labels]` sequence-classification logits."""
        raise NotImplementedError

    def classify_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """`[n, hidden]` token rows -> `[n, num_labels]` token-classification logits."""
        raise NotImplementedError

    def compute_logits(
        self, rows: torch.Tensor, vocab_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`[n, hidden]` token rows -> `[n, vocab]` language-model logits, or `[n, len(vocab_ids)]`
        for only those vocabulary entries."""
        raise NotImplementedError

    def project_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """`[n, hidden]` token rows -> `[n, dim]` late-interaction vectors (ColBERT projection)."""
        raise NotImplementedError

    def project_listwise(self, rows: torch.Tensor) -> torch.Tensor:
        """`[n, hidden]` rows at a listwise reranker's marker tokens -> `[n, dim]` vectors
        whose cosines score the documents (jina-reranker-v3's projector)."""
        raise NotImplementedError

    @property
    def default_pooler(self) -> str:
        """Sequence pooling when the folder does not say: LAST for causal models, else CLS."""
        return "LAST" if self.is_causal else "CLS"

    def drop_parameter(self, name: str) -> None:
        """Forget optional parameter `name`, which the checkpoint does not have."""
        raise NotImplementedError(name)

    def post_load(self) -> None:
        """Called once the weights are in place: joins the projections that share an input
        (q/k/v, gate/up) into one matmul each, in every submodule that offers it."""
        for module in list(self.modules()):
            fuse_projections = getattr(module, "fuse_projections", None)
            if callable(fuse_projections):
                fuse_projections()


def hf_num_labels(hf: dict[str, Any]) -> int:
    """A classifier's output count, as transformers reads it: `id2label`, else `num_labels`
    (default 2)."""
    id2label = hf.get("id2label")
    if id2label:
        return len(id2label)
    return int(hf.get("num_labels") or 2)
