"""Checkpoint layouts that transformers loads without missing weights load here, with the same
outputs; what transformers reports missing (or knowingly leaves unread) stays an error.

Each case saves a tiny random model with transformers, rewrites its safetensors into an older or
other layout (gamma/beta LayerNorm names, base-model prefix stripped or added, masked-LM and
causal-LM heads tied or untied, stored or not), checks what transformers' `from_pretrained` reports
on the rewritten folder, then compares the engine with the model transformers loaded from it:
final hidden states and the head's logits within 1e-5 of the reference's largest magnitude (fp32).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import vecpool
from tests.conftest import tiny_bert_config
from tests.helpers import assert_rel_close, engine_hidden, hf_last_hidden, random_prompts
from tests.models.test_decoders import ARCH_IDS, ARCHS, Arch
from vecpool.models.base import Capability

Tensors = dict[str, torch.Tensor]
Edit = Callable[[Tensors], Tensors]
RTOL = 1e-5
ENCODER_VOCAB = 99
ENCODER_LENGTHS = [5, 17, 3]
DECODER_LENGTHS = [4, 13]


def _encoder_config(family: str, **overrides: Any) -> Any:
    """A tiny BERT, RoBERTa or XLM-RoBERTa config (weights large enough for heads to matter)."""
    if family == "bert":
        return tiny_bert_config(initializer_range=0.2, **overrides)
    cls = transformers.RobertaConfig if family == "roberta" else transformers.XLMRobertaConfig
    return cls(
        vocab_size=ENCODER_VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=66,
        type_vocab_size=1,
        pad_token_id=1,
        initializer_range=0.2,
        # Not the exact gelu that RoBERTa's masked-LM head uses whatever hidden_act says.
        hidden_act="gelu_new",
        **overrides,
    )


def _encoder_class(family: str, suffix: str) -> Any:
    prefix = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta"}[family]
    return getattr(transformers, prefix + suffix)


def _new(cls: Any, config: Any) -> Any:
    torch.manual_seed(0)
    return cls(config).eval()


def _save(model: Any, folder: Path, edit: Edit | None = None, **config: Any) -> Path:
    """Save `model` to `folder`, its tensors rewritten by `edit` and config.json updated."""
    model.save_pretrained(str(folder))
    path = folder / "model.safetensors"
    if edit is not None:
        tensors = edit(load_file(str(path)))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    if config:
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **config}))
    return folder


def _hf_load(cls: Any, folder: Path, **kwargs: Any) -> tuple[Any, dict[str, set[str]]]:
    model, info = cls.from_pretrained(
        str(folder), output_loading_info=True, attn_implementation="eager", **kwargs
    )
    return model.eval(), info


def _compare(folder: Path, hf: Any, lengths: list[int], head: str | None = None) -> vecpool.Engine:
    """Engine and `hf` agree on hidden states and, for `head`, on its logits (the hidden
    states through token_embed, which a classifier's engine serves only when asked)."""
    engine = vecpool.Engine(folder, device="cpu", tasks=("token_embed",))
    prompts = random_prompts(engine.model.vocab_size, lengths, seed=len(lengths))
    for prompt, hidden in zip(prompts, engine_hidden(engine, prompts), strict=True):
        assert_rel_close(hidden, hf_last_hidden(hf, prompt), rtol=RTOL)
        if head is None:
            continue
        rows = torch.from_numpy(hidden)
        with torch.no_grad():
            expected = hf(input_ids=torch.tensor([prompt])).logits[0].numpy()
            if head == "logits":
                ours = engine.model.compute_logits(rows).numpy()
            elif head == "first":  # a BERT-family sequence classifier reads the first row
                ours, expected = engine.model.classify(rows[:1]).numpy(), expected[None]
            else:  # "last": a decoder sequence classifier reads the last row
                ours, expected = engine.model.classify(rows[-1:]).numpy(), expected[None]
        assert_rel_close(ours, expected, rtol=RTOL)
    return engine


def _renamed(old: str, new: str) -> Edit:
    return lambda t: {re.sub(old, new, k): v for k, v in t.items()}


def _gamma_beta(tensors: Tensors) -> Tensors:
    """Every `LayerNorm.weight` / `.bias` as TensorFlow-era checkpoints name them."""
    return _renamed(r"LayerNorm\.bias$", "LayerNorm.beta")(
        _renamed(r"LayerNorm\.weight$", "LayerNorm.gamma")(tensors)
    )


# --- BERT family ---------------------------------------------------------------------------

FAMILIES = ["bert", "roberta", "xlm-roberta"]
PREFIX = {"bert": "bert.", "roberta": "roberta.", "xlm-roberta": "roberta."}


def _mlm_names(family: str) -> tuple[str, str, str]:
    """(decoder weight, decoder bias, head bias) names of the family's masked-LM head."""
    head = "cls.predictions" if family == "bert" else "lm_head"
    return f"{head}.decoder.weight", f"{head}.decoder.bias", f"{head}.bias"


@pytest.mark.parametrize("family", FAMILIES)
def test_gamma_beta_layer_norms(family: str, tmp_path: Path) -> None:
    """Older checkpoints name LayerNorm parameters gamma/beta; transformers renames them (in
    every `LayerNorm`, the masked-LM head's too; RoBERTa's `lm_head.layer_norm` is covered by
    `test_refused_layouts`)."""
    cls = _encoder_class(family, "ForMaskedLM")
    folder = _save(_new(cls, _encoder_config(family)), tmp_path, _gamma_beta)
    stored = load_file(str(folder / "model.safetensors"))
    assert sum(k.endswith("LayerNorm.gamma") for k in stored) == (6 if family == "bert" else 5)
    hf, info = _hf_load(cls, folder)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    _compare(folder, hf, ENCODER_LENGTHS, head="logits")


@pytest.mark.parametrize("head", ["ForMaskedLM", "ForSequenceClassification"])
@pytest.mark.parametrize("family", FAMILIES)
def test_head_checkpoint_without_prefix(family: str, head: str, tmp_path: Path) -> None:
    """A head class's checkpoint whose base tensors lack the base-model prefix (saved from the
    base model, head added): transformers adds the prefix back."""
    cls = _encoder_class(family, head)
    folder = _save(_new(cls, _encoder_config(family)), tmp_path, _renamed(f"^{PREFIX[family]}", ""))
    assert not any(
        k.startswith(PREFIX[family]) for k in load_file(str(folder / "model.safetensors"))
    )
    hf, info = _hf_load(cls, folder)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    _compare(folder, hf, ENCODER_LENGTHS, head="logits" if head == "ForMaskedLM" else "first")


@pytest.mark.parametrize("family", FAMILIES)
def test_base_checkpoint_with_prefix(family: str, tmp_path: Path) -> None:
    """A base model's checkpoint with every name under the prefix: transformers strips it."""
    cls = _encoder_class(family, "Model")
    folder = _save(_new(cls, _encoder_config(family)), tmp_path, _renamed("^", PREFIX[family]))
    hf, info = _hf_load(cls, folder)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    _compare(folder, hf, ENCODER_LENGTHS)


@pytest.mark.parametrize("head", ["ForMaskedLM", "ForSequenceClassification"])
@pytest.mark.parametrize("family", FAMILIES)
def test_base_model_from_head_checkpoint(family: str, head: str, tmp_path: Path) -> None:
    """A base architecture over a head class's checkpoint: the prefixed tensors load, the head's
    are left unread, as transformers' base class reports them (unexpected, not missing)."""
    base = _encoder_class(family, "Model")
    folder = _save(
        _new(_encoder_class(family, head), _encoder_config(family)),
        tmp_path,
        architectures=[base.__name__],
    )
    # Without the pooler, which vecpool's base models do not have either.
    hf, info = _hf_load(base, folder, add_pooling_layer=False)
    assert not info["missing_keys"]
    pooler = f"{PREFIX[family]}pooler."
    unread = {k for k in info["unexpected_keys"] if not k.startswith(pooler)}
    assert unread and not any(k.startswith(PREFIX[family]) for k in unread)
    _compare(folder, hf, ENCODER_LENGTHS)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    ("tied", "stored"),
    [(True, "none"), (True, "equal"), (True, "different"), (False, "different")],
)
def test_masked_lm_decoder(family: str, tied: bool, stored: str, tmp_path: Path) -> None:
    """Tied, the decoder is the word embeddings (and the head's bias) when the checkpoint omits
    it or stores it equal; stored different, transformers keeps it untied, and so do we. Untied,
    the stored decoder is used."""
    cls = _encoder_class(family, "ForMaskedLM")
    weight, bias, head_bias = _mlm_names(family)
    embeddings = f"{PREFIX[family]}embeddings.word_embeddings.weight"

    def edit(t: Tensors) -> Tensors:
        gen = torch.Generator().manual_seed(9)
        if stored == "equal":
            return {**t, weight: t[embeddings].clone(), bias: t[head_bias].clone()}
        if stored == "different":
            return {
                **t,
                weight: torch.randn(t[embeddings].shape, generator=gen) * 0.2,
                bias: torch.randn(t[head_bias].shape, generator=gen),
            }
        return t

    folder = _save(_new(cls, _encoder_config(family, tie_word_embeddings=tied)), tmp_path, edit)
    assert (weight in load_file(str(folder / "model.safetensors"))) == (stored != "none")
    hf, info = _hf_load(cls, folder)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    engine = _compare(folder, hf, ENCODER_LENGTHS, head="logits")
    model = engine.model
    decoder = model.get_parameter(weight)
    assert (decoder is model.embeddings.word_embeddings.weight) == (tied and stored != "different")
    assert Capability.MASKED_LM in model.capabilities


def test_roberta_splade(tmp_path: Path) -> None:
    """SPLADE through the engine on a RoBERTa masked-LM checkpoint: max over positions of
    log(1 + relu(logits)), against transformers' logits."""
    cls = transformers.RobertaForMaskedLM
    folder = _save(_new(cls, _encoder_config("roberta")), tmp_path)
    hf, _ = _hf_load(cls, folder)
    engine = vecpool.Engine(folder, device="cpu")
    prompts = random_prompts(ENCODER_VOCAB, ENCODER_LENGTHS, seed=2)
    for prompt, row in zip(prompts, engine.encode(prompts, task="sparse"), strict=True):
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([prompt])).logits[0]
        expected = torch.log1p(torch.relu(logits)).max(dim=0).values.numpy()
        assert_rel_close(row, expected, rtol=RTOL)


# --- decoders ------------------------------------------------------------------------------


def _seq_cls_class(arch: Arch) -> Any:
    return getattr(transformers, arch.base.__name__.replace("Model", "ForSequenceClassification"))


@pytest.mark.parametrize("arch", ARCHS, ids=ARCH_IDS)
def test_decoder_head_checkpoints_without_prefix(arch: Arch, tmp_path: Path) -> None:
    """`*ForCausalLM` (untied) and `*ForSequenceClassification` checkpoints whose base tensors
    lack `model.`: transformers adds the prefix back."""
    strip = _renamed(r"^model\.", "")
    lm = arch.hf_model(causal_lm=True, tie_word_embeddings=False)
    folder = _save(lm, tmp_path / "lm", strip)
    hf, info = _hf_load(arch.causal_lm, folder)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    _compare(folder, hf, DECODER_LENGTHS, head="logits")

    scorer = _new(_seq_cls_class(arch), arch.hf_config(num_labels=3))
    folder = _save(scorer, tmp_path / "cls", strip)
    hf, info = _hf_load(_seq_cls_class(arch), folder)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    _compare(folder, hf, DECODER_LENGTHS, head="last")


@pytest.mark.parametrize("arch", ARCHS, ids=ARCH_IDS)
def test_decoder_base_layouts(arch: Arch, tmp_path: Path) -> None:
    """A base checkpoint with every name under `model.`, and a base architecture over a
    `*ForCausalLM` checkpoint (its `lm_head.weight` unread, as transformers reports it)."""
    folder = _save(arch.hf_model(), tmp_path / "prefixed", _renamed("^", "model."))
    hf, info = _hf_load(arch.base, folder)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    _compare(folder, hf, DECODER_LENGTHS)

    lm = arch.hf_model(causal_lm=True, tie_word_embeddings=False)
    folder = _save(lm, tmp_path / "from_lm", architectures=[arch.base.__name__])
    hf, info = _hf_load(arch.base, folder)
    assert not info["missing_keys"] and info["unexpected_keys"] == {"lm_head.weight"}
    _compare(folder, hf, DECODER_LENGTHS)


@pytest.mark.parametrize("arch", ARCHS, ids=ARCH_IDS)
@pytest.mark.parametrize("stored", ["equal", "different", "head_only"])
def test_tied_decoder_with_stored_head(arch: Arch, stored: str, tmp_path: Path) -> None:
    """Tied config, `lm_head.weight` stored: equal to the embeddings, one tensor serves both;
    different, transformers keeps it untied, and so do we; stored without the embeddings,
    transformers ties the embeddings to it."""

    def edit(t: Tensors) -> Tensors:
        embed = t["model.embed_tokens.weight"]
        if stored == "equal":
            return {**t, "lm_head.weight": embed.clone()}
        if stored == "different":
            gen = torch.Generator().manual_seed(9)
            return {**t, "lm_head.weight": torch.randn(embed.shape, generator=gen) * 0.2}
        rest = {k: v for k, v in t.items() if k != "model.embed_tokens.weight"}
        return {**rest, "lm_head.weight": embed.clone()}

    folder = _save(arch.hf_model(causal_lm=True, tie_word_embeddings=True), tmp_path, edit)
    hf, info = _hf_load(arch.causal_lm, folder)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    model = _compare(folder, hf, DECODER_LENGTHS, head="logits").model
    assert model.lm_head is not None
    assert (model.lm_head.weight is model.embed_tokens.weight) == (stored != "different")


# --- what stays refused --------------------------------------------------------------------


def _bert_mlm(tmp_path: Path, edit: Edit, tied: bool = True, **config: Any) -> Path:
    model = _new(transformers.BertForMaskedLM, _encoder_config("bert", tie_word_embeddings=tied))
    return _save(model, tmp_path, edit, **config)


def _without(*names: str) -> Edit:
    return lambda t: {k: v for k, v in t.items() if k not in names}


def _with(name: str) -> Edit:
    return lambda t: {**t, name: torch.zeros(3)}


REFUSED: list[tuple[str, Callable[[Path], tuple[Any, Path]], str, str]] = [
    # (case, build -> (transformers class, folder), what transformers reports, what we name)
    (
        "missing_gamma",
        lambda p: (
            transformers.BertForMaskedLM,
            _bert_mlm(
                p, lambda t: _without("bert.encoder.layer.1.output.LayerNorm.gamma")(_gamma_beta(t))
            ),
        ),
        "missing",
        "encoder.layer.1.output.LayerNorm.weight",
    ),
    (
        # Only `LayerNorm.gamma` is a legacy name; a bare `gamma` is not renamed.
        "bare_gamma",
        lambda p: (
            transformers.BertForMaskedLM,
            _bert_mlm(p, _renamed(r"embeddings\.LayerNorm\.weight$", "embeddings.gamma")),
        ),
        "missing",
        "bert.embeddings.gamma",
    ),
    (
        # RoBERTa's head norm is `layer_norm`: transformers does not rename its gamma.
        "roberta_head_gamma",
        lambda p: (
            transformers.RobertaForMaskedLM,
            _save(
                _new(transformers.RobertaForMaskedLM, _encoder_config("roberta")),
                p,
                _renamed(r"lm_head\.layer_norm\.weight$", "lm_head.layer_norm.gamma"),
            ),
        ),
        "missing",
        "lm_head.layer_norm.gamma",
    ),
    (
        "untied_mlm_without_decoder",
        lambda p: (
            transformers.BertForMaskedLM,
            _bert_mlm(p, _without("cls.predictions.decoder.weight"), tied=False),
        ),
        "missing",
        "cls.predictions.decoder.weight",
    ),
    (
        # Saved from the base model: the head transformers would initialize at random.
        "mlm_from_base_checkpoint",
        lambda p: (
            transformers.BertForMaskedLM,
            _save(
                _new(transformers.BertModel, _encoder_config("bert")),
                p,
                architectures=["BertForMaskedLM"],
            ),
        ),
        "missing",
        "cls.predictions.transform.dense.weight",
    ),
    (
        "classifier_from_base_checkpoint",
        lambda p: (
            transformers.BertForSequenceClassification,
            _save(
                _new(transformers.BertModel, _encoder_config("bert")),
                p,
                architectures=["BertForSequenceClassification"],
            ),
        ),
        "missing",
        "classifier.weight",
    ),
    (
        # Left unread only outside the prefix of a head checkpoint: inside it, still unexpected.
        "extra_under_prefix",
        lambda p: (
            transformers.BertModel,
            _save(
                _new(transformers.BertForSequenceClassification, _encoder_config("bert")),
                p,
                _with("bert.encoder.layer.0.extra.weight"),
                architectures=["BertModel"],
            ),
        ),
        "unexpected",
        "bert.encoder.layer.0.extra.weight",
    ),
    (
        # A base-layout checkpoint (no prefix) with a head tensor is not a head checkpoint.
        "head_tensor_in_base_checkpoint",
        lambda p: (
            transformers.BertModel,
            _save(
                _new(transformers.BertModel, _encoder_config("bert")), p, _with("classifier.weight")
            ),
        ),
        "unexpected",
        "classifier.weight",
    ),
]


@pytest.mark.parametrize(
    ("build", "reported", "named"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED]
)
def test_refused_layouts(
    build: Callable[[Path], tuple[Any, Path]], reported: str, named: str, tmp_path: Path
) -> None:
    """What transformers reports missing is an error naming the tensor; so is a tensor it
    reports unexpected outside the head-checkpoint case."""
    hf_cls, folder = build(tmp_path)
    _, info = _hf_load(hf_cls, folder)
    if reported == "missing":
        assert info["missing_keys"]
    else:
        assert named in info["unexpected_keys"] and not info["missing_keys"]
    with pytest.raises(vecpool.ModelLoadError) as error:
        vecpool.Engine(folder, device="cpu")
    assert named in str(error.value)


@pytest.mark.parametrize("arch", ARCHS, ids=ARCH_IDS)
def test_untied_causal_lm_without_head(arch: Arch, tmp_path: Path) -> None:
    """Untied and saved from `*ForCausalLM` (`model.` names) but without `lm_head.weight`:
    transformers reports it missing, so it is an error. (The base model's layout under a
    `*ForCausalLM` name, as Qwen3-Embedding-8B ships, loads as an embedding model: see
    `test_embedding_checkpoint_without_head_loads`.)"""
    lm = arch.hf_model(causal_lm=True, tie_word_embeddings=False)
    folder = _save(lm, tmp_path, _without("lm_head.weight"))
    _, info = _hf_load(arch.causal_lm, folder)
    assert info["missing_keys"] == {"lm_head.weight"}
    with pytest.raises(vecpool.ModelLoadError, match=r"missing tensors for \w+: lm_head\.weight$"):
        vecpool.Engine(folder, device="cpu")
