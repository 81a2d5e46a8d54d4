"""The transformers fallback: a folder whose architecture has no native class runs through the
`transformers` class its config names, on the same engine, pooling, tasks, server and CLI.

Slower than a native class: each step's flat batch is scattered into a padded
`[num_seqs, max_len, hidden]` layout, run through the Hugging Face base model with an attention
mask (and token types where it takes them), and the final hidden states are gathered back into
flat rows. Every prompt runs whole (`step_optimizations = False`): no chunked prefill, CUDA
graphs or compiled layers. `embed_input_ids` is the class's own `get_input_embeddings()`, and the
base model continues from `inputs_embeds`, so prompt embeds give what token ids give.

Heads run on the rows the pooling runner selected, as for native classes, so a classify and an
embed request share a step. The head is the class's one child module besides its base model
(dropout aside):
- sequence classification: a linear `score` on the last row (decoders: GPT-NeoX, OPT, Falcon,
  BLOOM, GPT-2, GPT-J, MPT, Phi, StableLM, ...); a linear `classifier` after the base model's
  `pooler` on the first row (BERT style: ERNIE, MegatronBERT, ...), or on the first row itself
  when the base model has no pooler; a classifier module that reads its input's first row
  (RoBERTa style: dense, tanh, out_proj: CamemBERT, Data2VecText, XLM-RoBERTa-XL, ...);
- token classification, masked-LM and causal-LM logits: the head module on each row.
At load every head is checked against the class's own forward on a short probe prompt; a class
whose head is anything else (XLNet's sequence summary, BART's end-of-sequence rows, several head
modules) is refused with an error that says so.
"""

from __future__ import annotations

import inspect
import logging
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vecpool.errors import ConfigError, ModelLoadError
from vecpool.models.base import Capability, PoolingModel
from vecpool.models.hf import hf_get
from vecpool.models.layers.attention import AttentionMetadata
from vecpool.models.loading.folder import ModelFolder
from vecpool.models.loading.registry import supported_architectures

_LOG = logging.getLogger(__name__)

# The ending of an architecture's name -> the transformers auto class that loads it and the head
# the class brings; any other name loads through AutoModel (hidden states only).
_HEAD_CLASSES: tuple[tuple[str, str, Capability], ...] = (
    (
        "ForSequenceClassification",
        "AutoModelForSequenceClassification",
        Capability.SEQUENCE_CLASSIFIER,
    ),
    ("ForTokenClassification", "AutoModelForTokenClassification", Capability.TOKEN_CLASSIFIER),
    ("ForMaskedLM", "AutoModelForMaskedLM", Capability.MASKED_LM),
    ("ForCausalLM", "AutoModelForCausalLM", Capability.CAUSAL_LM),
    ("LMHeadModel", "AutoModelForCausalLM", Capability.CAUSAL_LM),
)
# The config keys that state a model's position limit, in the order they are read.
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx")
# The limit of a model whose config states none (ALiBi, relative positions): a request may not
# be longer, and `max_model_len` may lower it.
UNSTATED_POSITIONS = 8192
# Tokens of the prompt the load-time checks run.
_PROBE_LENGTH = 6
# How close (relative to the reference's largest magnitude) the checks hold what they compare.
_CHECK_RTOL = {torch.float32: 1e-4, torch.float64: 1e-8}
_HALF_CHECK_RTOL = 3e-2
# One step of a head: a module of the transformers class, and whether it takes its rows as
# sequences of one row (`[n, 1, hidden]`, a module that reads its input's first row).
_Step = tuple[nn.Module, bool]


class TransformersModel(PoolingModel):
    """Any architecture `transformers` can load, run through its own module (see the module's
    docstring for the heads it covers). Built by `from_folder` only."""

    implementation = "transformers"
    step_optimizations = False

    def __init__(self, hf_model: Any, architecture: str, capability: Capability | None):
        super().__init__()
        self.hf = hf_model  # the transformers module: `hf.base_model` gives the hidden states
        self.architecture = architecture
        embeddings = hf_model.get_input_embeddings()
        self.embeddings: nn.Module = embeddings
        self.hidden_size = int(embeddings.embedding_dim)
        self.vocab_size = int(embeddings.num_embeddings)
        config = hf_model.config
        params = inspect.signature(hf_model.base_model.forward).parameters
        if "inputs_embeds" not in params:
            raise ConfigError(
                f"{architecture}: its transformers class takes no inputs_embeds, which "
                "vecpool's transformers fallback runs every batch through"
            )
        self._use_cache = "use_cache" in params  # decoders: no key/value cache is wanted
        self.uses_token_type_ids = (
            "token_type_ids" in params and int(getattr(config, "type_vocab_size", 0) or 0) > 1
        )
        self.max_positions = _max_positions(config.to_dict(), hf_model.base_model)
        probe = _probe_ids(self.vocab_size, getattr(config, "pad_token_id", None))
        self.is_causal = self._probe_causal(probe)
        self.classifier_pooler = "LAST" if self.is_causal else "CLS"
        self._head: list[_Step] = []  # plain list: the modules stay registered under `hf` only
        if capability is not None:
            self.capabilities = frozenset({capability})
            if capability in (Capability.SEQUENCE_CLASSIFIER, Capability.TOKEN_CLASSIFIER):
                self.num_labels = int(config.num_labels)
            self._head = _head_steps(hf_model, architecture, capability, self.is_causal)
            self._check_head(capability, probe)

    @classmethod
    def from_folder(
        cls, folder: ModelFolder, device: torch.device, dtype: torch.dtype
    ) -> PoolingModel:
        """Load the folder through `from_pretrained` (local files only, no remote code), in
        `dtype` on `device`; refuse what the fallback cannot serve, naming why."""
        architecture, hf = folder.architecture, folder.hf_config
        config_path = folder.path / "config.json"
        if hf.get("auto_map"):
            raise ModelLoadError(
                f"{config_path}: architecture {architecture!r} runs through transformers only "
                "with the modelling code shipped in its folder (auto_map), and vecpool never "
                f"runs code from a model folder (supported natively: {_native()})"
            )
        transformers = _import_transformers(architecture)
        if not hasattr(transformers, architecture):
            version = transformers.__version__
            why = (
                f"it is no transformers {version} class (its native class runs with "
                "model_impl='auto')"
                if architecture in supported_architectures()
                else f"vecpool has no native class for it and transformers {version} does not "
                "know it either"
            )
            raise ConfigError(
                f"architecture {architecture!r} is not supported through transformers: {why} "
                f"(supported natively: {_native()})"
            )
        auto_name, capability = _auto_class(architecture)
        # transformers before 4.56 names the argument `torch_dtype` (and ignores `dtype`).
        dtype_arg = "dtype" if _version(transformers.__version__) >= (4, 56) else "torch_dtype"
        try:
            hf_model, info = getattr(transformers, auto_name).from_pretrained(
                str(folder.path),
                local_files_only=True,
                trust_remote_code=False,
                output_loading_info=True,
                **{dtype_arg: dtype},
            )
        except (OSError, ValueError, KeyError, RuntimeError, ImportError) as exc:
            raise ModelLoadError(
                f"transformers could not load {architecture} from {folder.path}: {exc}"
            ) from exc
        _check_loading_info(info, architecture, strict_unexpected=capability is not None)
        hf_model = hf_model.to(device).eval().requires_grad_(False)
        model = cls(hf_model, architecture, capability).eval()
        _LOG.warning(
            "running %s through transformers: slower; native families are listed in the README",
            architecture,
        )
        return model

    # ---- the forward ------------------------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.embeddings(input_ids)  # [num_tokens, hidden]
        return out

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens]: unused, the class numbers its whole prompts
        attn: AttentionMetadata,
        token_type_ids: torch.Tensor | None = None,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, hidden]
        # Every prompt runs whole (`step_optimizations` is False): nothing is cached.
        assert attn.kv is None, "the transformers fallback runs no prompt in chunks"
        rows = (attn.seq_ids, attn.pos_in_seq)  # each flat row's place in the padded layout
        shape = (attn.num_seqs, attn.max_seqlen)
        padded = inputs_embeds.new_zeros(*shape, inputs_embeds.shape[-1])  # [seqs, len, hidden]
        padded[rows] = inputs_embeds
        # Keys every query attends to: the whole sequence, or its first rows (query expansion).
        cu_k = attn.cu_seqlens if attn.cu_seqlens_k is None else attn.cu_seqlens_k
        key_lengths = cu_k[1:] - cu_k[:-1]  # [num_seqs]
        steps = torch.arange(attn.max_seqlen, device=inputs_embeds.device)
        mask = (steps[None, :] < key_lengths[:, None]).long()  # [num_seqs, max_len]
        kwargs: dict[str, Any] = {}
        if self.uses_token_type_ids and token_type_ids is not None:
            types = token_type_ids.new_zeros(shape)  # [num_seqs, max_len]
            types[rows] = token_type_ids
            kwargs["token_type_ids"] = types
        if self._use_cache:
            kwargs["use_cache"] = False
        hidden = self.hf.base_model(inputs_embeds=padded, attention_mask=mask, **kwargs)[0]
        out: torch.Tensor = hidden[rows]  # [num_tokens, hidden]
        return out

    # ---- heads --------------------------------------------------------------------------

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return _run_head(self._head, pooled)

    def classify_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        return _run_head(self._head, rows)

    def compute_logits(
        self, rows: torch.Tensor, vocab_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        if vocab_ids is None:
            return _run_head(self._head, rows)
        if len(self._head) == 1 and isinstance(self._head[0][0], nn.Linear):
            head = self._head[0][0]  # a plain projection: only the columns asked for
            bias = None if head.bias is None else head.bias[vocab_ids]
            return F.linear(rows, head.weight[vocab_ids], bias)
        return _run_head(self._head, rows)[:, vocab_ids]

    # ---- load-time checks ---------------------------------------------------------------

    @torch.inference_mode()
    def _base_hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """`[n]` ids -> `[n, hidden]` final hidden states of one unpadded prompt, through the
        flat forward."""
        n = ids.shape[0]
        device = ids.device
        meta = AttentionMetadata(
            cu_seqlens=torch.tensor([0, n], dtype=torch.int32, device=device),
            max_seqlen=n,
            seq_ids=torch.zeros(n, dtype=torch.int64, device=device),
            pos_in_seq=torch.arange(n, device=device),
            use_varlen=False,
        )
        return self(self.embed_input_ids(ids), meta.pos_in_seq, meta)

    def _probe_causal(self, ids: torch.Tensor) -> bool:
        """Whether attention is causal: changing a prompt's last token changes none of the
        rows before it."""
        ids = ids.to(self._device)
        changed = ids.clone()
        changed[-1] = (ids[-1] + 1) % self.vocab_size
        before, after = self._base_hidden(ids)[:-1], self._base_hidden(changed)[:-1]
        return _close(after, before, 1e-6 if before.dtype == torch.float32 else 1e-3)

    @torch.inference_mode()
    def _check_head(self, capability: Capability, ids: torch.Tensor) -> None:
        """Refuse a class whose head the fallback did not find: its own forward on the probe
        prompt must give what the head on the selected rows gives."""
        ids = ids.to(self._device)
        expected = self.hf(input_ids=ids[None]).logits[0].float()
        hidden = self._base_hidden(ids)
        if capability is Capability.SEQUENCE_CLASSIFIER:
            row = hidden[-1:] if self.classifier_pooler == "LAST" else hidden[:1]
            actual = self.classify(row)[0].float()
        else:
            actual = _run_head(self._head, hidden).float()
        rtol = _CHECK_RTOL.get(hidden.dtype, _HALF_CHECK_RTOL)
        if actual.shape != expected.shape or not _close(actual, expected, rtol):
            raise ConfigError(
                f"{self.architecture}: vecpool's transformers fallback cannot serve its "
                f"{capability.value} head: the head module it found does not give what "
                f"{type(self.hf).__name__} gives (it serves heads that are a function of one "
                "row: see vecpool/models/loading/transformers_fallback.py); load the base model's "
                "architecture for hidden states"
            )

    @property
    def _device(self) -> torch.device:
        return next(self.embeddings.parameters()).device


def _import_transformers(architecture: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise ModelLoadError(
            f"architecture {architecture!r} has no native vecpool class and runs through "
            "transformers, which is not installed: pip install 'vecpool[hf]' (supported "
            f"natively: {_native()})"
        ) from None
    return transformers


def _version(text: str) -> tuple[int, ...]:
    """The major and minor numbers of a version string: "4.57.1" -> (4, 57)."""
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


def _native() -> str:
    return ", ".join(supported_architectures())


def _auto_class(architecture: str) -> tuple[str, Capability | None]:
    """The auto class that loads `architecture`, and the head it brings."""
    for ending, auto_name, capability in _HEAD_CLASSES:
        if architecture.endswith(ending):
            return auto_name, capability
    return "AutoModel", None


def _check_loading_info(info: dict[str, Any], architecture: str, strict_unexpected: bool) -> None:
    """Loading is strict, as the native loader's: a missing or mis-shaped tensor is an error,
    and so is an unexpected one unless the class is a base model (a head checkpoint's head is
    then left out, as transformers does)."""
    problems = {
        "missing": sorted(map(str, info.get("missing_keys") or ())),
        "mis-shaped": sorted(map(str, info.get("mismatched_keys") or ())),
        "unexpected": sorted(map(str, info.get("unexpected_keys") or ()))
        if strict_unexpected
        else [],
    }
    found = {kind: names for kind, names in problems.items() if names}
    if found:
        listed = "; ".join(f"{kind}: {', '.join(names[:10])}" for kind, names in found.items())
        raise ModelLoadError(f"{architecture} through transformers: tensors {listed}")


def _max_positions(config: dict[str, Any], base: nn.Module) -> int:
    """The longest prompt: the config's position limit, less the positions a RoBERTa-style
    embedding numbers from after its padding index; `UNSTATED_POSITIONS` when it states none."""
    limit = hf_get(config, *_POSITION_KEYS)
    if limit is None:
        return UNSTATED_POSITIONS
    table = getattr(getattr(base, "embeddings", None), "position_embeddings", None)
    if isinstance(table, nn.Embedding) and table.padding_idx is not None:
        return min(int(limit), table.num_embeddings - table.padding_idx - 1)
    return int(limit)


def _probe_ids(vocab_size: int, pad_token_id: Any) -> torch.Tensor:
    """`[_PROBE_LENGTH]` token ids spread over the vocabulary, none of them padding."""
    ids = (torch.arange(_PROBE_LENGTH) * 7919 + 3) % vocab_size
    if isinstance(pad_token_id, int):
        ids = torch.where(ids == pad_token_id, (ids + 1) % vocab_size, ids)
    return ids


def _head_steps(
    hf_model: nn.Module, architecture: str, capability: Capability, causal: bool
) -> list[_Step]:
    """The head of a transformers `*For*` class as steps on selected rows (see the module's
    docstring); a `ConfigError` for a class with no single head module."""
    base = hf_model.base_model
    heads = [
        module
        for module in hf_model.children()
        if module is not base and not isinstance(module, nn.Dropout)
    ]
    if len(heads) != 1:
        names = [n for n, m in hf_model.named_children() if m is not base]
        raise ConfigError(
            f"{architecture}: vecpool's transformers fallback cannot serve its "
            f"{capability.value} head: it serves one head module on selected rows, the class "
            f"has {names}"
        )
    head = heads[0]
    if capability is not Capability.SEQUENCE_CLASSIFIER:
        return [(head, False)]
    if not isinstance(head, nn.Linear):
        return [(head, True)]  # RoBERTa style: the module reads its input's first row
    pooler = getattr(base, "pooler", None)
    if not causal and isinstance(pooler, nn.Module):
        return [(pooler, True), (head, False)]  # BERT style: the pooler reads the first row
    return [(head, False)]


def _run_head(steps: list[_Step], rows: torch.Tensor) -> torch.Tensor:
    """`[n, hidden]` rows through the head's steps -> `[n, outputs]`."""
    x = rows
    for module, as_sequence in steps:
        x = module(x[:, None]) if as_sequence else module(x)
    return x


def _close(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> bool:
    scale = float(expected.abs().max())
    return float((actual.float() - expected.float()).abs().max()) <= rtol * max(scale, 1e-30)
