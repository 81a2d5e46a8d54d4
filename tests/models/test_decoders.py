"""Decoder architectures (Qwen3, Llama, Mistral, Gemma2, Qwen2, Gemma, Gemma3) against Hugging
Face transformers.

Every architecture runs with grouped-query attention; Qwen3, Mistral, Gemma2, Qwen2 and Gemma3
with sliding windows shorter than the longer prompts, Gemma2 with soft-capping, Gemma3 with two
rotary bases (scaled on its global layers). Hugging Face runs each
prompt alone and unpadded, with eager attention; the engine runs them in one flat batch.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import vecpool
from tests.helpers import (
    REORDERED_RTOL,
    assert_rel_close,
    engine_hidden,
    hf_last_hidden,
    random_prompts,
    save_hf_model,
)
from vecpool.models.loading.loader import model_class

LENGTHS = [3, 9, 17, 30]
VOCAB = 101
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA: two query heads per key/value head
    max_position_embeddings=128,
    initializer_range=0.2,  # large enough weights that caps and windows change the outputs
)


@dataclass(frozen=True)
class Arch:
    name: str
    base: Callable[..., Any]  # transformers *Model class
    causal_lm: Callable[..., Any]  # transformers *ForCausalLM class
    config: Callable[..., Any]  # transformers config class
    options: dict[str, Any]  # what this test exercises beyond COMMON
    own_tensor: str  # a tensor only this architecture's layout has

    def hf_config(self, **overrides: Any) -> Any:
        cfg = self.config(**{**COMMON, **self.options, **overrides})
        cfg._attn_implementation = "eager"
        return cfg

    def hf_model(self, causal_lm: bool = False, **overrides: Any) -> Any:
        torch.manual_seed(0)
        cls = self.causal_lm if causal_lm else self.base
        return cls(self.hf_config(**overrides)).eval()


ARCHS = [
    Arch(
        "qwen3",
        transformers.Qwen3Model,
        transformers.Qwen3ForCausalLM,
        transformers.Qwen3Config,
        # Sliding windows on the layers from max_window_layers on.
        dict(head_dim=16, use_sliding_window=True, sliding_window=6, max_window_layers=1),
        "layers.0.self_attn.q_norm.weight",
    ),
    Arch(
        "llama",
        transformers.LlamaModel,
        transformers.LlamaForCausalLM,
        transformers.LlamaConfig,
        dict(
            head_dim=16,  # not hidden_size / num_heads
            attention_bias=True,
            mlp_bias=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
        "layers.0.mlp.up_proj.bias",
    ),
    Arch(
        "mistral",
        transformers.MistralModel,
        transformers.MistralForCausalLM,
        transformers.MistralConfig,
        dict(sliding_window=5, rope_parameters=dict(rope_type="default", rope_theta=1e6)),
        "layers.0.self_attn.k_proj.weight",
    ),
    Arch(
        "gemma2",
        transformers.Gemma2Model,
        transformers.Gemma2ForCausalLM,
        transformers.Gemma2Config,
        dict(
            head_dim=8,
            sliding_window=6,
            query_pre_attn_scalar=12,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        ),
        "layers.1.pre_feedforward_layernorm.weight",
    ),
    Arch(
        "qwen2",
        transformers.Qwen2Model,
        transformers.Qwen2ForCausalLM,
        transformers.Qwen2Config,
        # Biases on q/k/v (not o); sliding windows on the layers from max_window_layers on.
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
        "layers.0.self_attn.k_proj.bias",
    ),
    Arch(
        "gemma",
        transformers.GemmaModel,
        transformers.GemmaForCausalLM,
        transformers.GemmaConfig,
        dict(head_dim=16, hidden_act="gelu"),  # read as its tanh approximation
        "layers.2.post_attention_layernorm.weight",
    ),
    Arch(
        "gemma3",
        transformers.Gemma3TextModel,
        transformers.Gemma3ForCausalLM,
        transformers.Gemma3TextConfig,
        dict(
            head_dim=8,
            sliding_window=6,
            query_pre_attn_scalar=12,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            # Two bases that differ, and scaling on the global layers only.
            rope_parameters={
                "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=50000.0),
                "sliding_attention": dict(rope_type="default", rope_theta=100.0),
            },
        ),
        "layers.1.self_attn.k_norm.weight",
    ),
]
ARCH_IDS = [a.name for a in ARCHS]


@dataclass
class Loaded:
    arch: Arch
    folder: Path
    hf: Any
    engine: vecpool.Engine


@pytest.fixture(scope="module", params=ARCHS, ids=ARCH_IDS)
def decoder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    arch: Arch = request.param
    hf = arch.hf_model()
    folder = save_hf_model(hf, tmp_path_factory.mktemp(arch.name))
    return Loaded(arch, folder, hf, vecpool.Engine(folder, device="cpu"))


def test_hidden_states_match_transformers(decoder: Loaded) -> None:
    prompts = random_prompts(VOCAB, LENGTHS)
    ours = engine_hidden(decoder.engine, prompts)
    for prompt, hidden in zip(prompts, ours, strict=True):
        assert_rel_close(hidden, hf_last_hidden(decoder.hf, prompt), rtol=1e-5)


def test_model_attributes(decoder: Loaded) -> None:
    model = decoder.engine.model
    assert (model.hidden_size, model.vocab_size, model.max_positions) == (32, VOCAB, 128)
    assert model.is_causal
    assert decoder.engine.defaults.pooler == "LAST"


def test_prompt_embeds_bit_exact_alone_and_mixed(decoder: Loaded) -> None:
    engine = decoder.engine
    prompts = random_prompts(VOCAB, LENGTHS, seed=4)
    as_ids = engine_hidden(engine, prompts)
    embeds = [{"prompt_embeds": engine.embed_tokens(p)} for p in prompts]
    alone = [engine_hidden(engine, [e])[0] for e in embeds]
    ids_alone = [engine_hidden(engine, [p])[0] for p in prompts]
    mixed = engine_hidden(engine, [embeds[0], prompts[1], embeds[2], prompts[3]])
    # Bit-exact by construction: the embeds are the model's own lookup, written into the rows
    # the ids would fill (same prompts, same order), so the forward is the same computation.
    for a, b, c, d in zip(as_ids, mixed, alone, ids_alone, strict=True):
        assert np.abs(a - b).max() == 0.0
        assert np.abs(c - d).max() == 0.0


def test_batch_invariance(decoder: Loaded) -> None:
    engine = decoder.engine
    prompts = random_prompts(VOCAB, [7, 2, 25, 13, 4, 19], seed=8)
    together = engine_hidden(engine, prompts)
    for prompt, rows in zip(prompts, together, strict=True):
        # Alone, a prompt runs through matmuls of other shapes than in the batch.
        assert_rel_close(engine_hidden(engine, [prompt])[0], rows, rtol=REORDERED_RTOL)
    pooled_alone = np.stack([engine.embed([p])[0] for p in prompts])
    assert np.abs(engine.embed(prompts) - pooled_alone).max() <= 1e-6


def test_embed_tokens_is_the_transformers_input_embedding(decoder: Loaded) -> None:
    # Prompt embeds mean what `inputs_embeds` means in transformers (Gemma2: scaled rows), so
    # embeddings made there give here exactly what the ids give.
    ids = random_prompts(VOCAB, [5], seed=5)[0]
    with torch.no_grad():
        theirs = decoder.hf.get_input_embeddings()(torch.tensor(ids))
    # A row lookup (and Gemma2's scaling, one multiplication per element): no sums to reorder.
    assert torch.equal(decoder.engine.embed_tokens(ids), theirs)
    from_hf = engine_hidden(decoder.engine, [{"prompt_embeds": theirs}])[0]
    assert np.array_equal(from_hf, engine_hidden(decoder.engine, [ids])[0])


def test_embedding_checkpoint_without_head_loads(tmp_path: Path) -> None:
    # Qwen3-Embedding-8B: a *ForCausalLM architecture, untied, and no lm_head stored.
    arch = next(a for a in ARCHS if a.name == "qwen3")
    hf = arch.hf_model()
    folder = save_hf_model(
        hf, tmp_path, architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False
    )
    engine = vecpool.Engine(folder, device="cpu")
    prompt = random_prompts(VOCAB, [7], seed=7)[0]
    assert_rel_close(engine_hidden(engine, [prompt])[0], hf_last_hidden(hf, prompt))
    with pytest.raises(vecpool.ConfigError, match=r"no lm_head\.weight"):
        engine.model.compute_logits(torch.zeros(1, 32))


def test_default_pooling_follows_attention(tmp_path: Path) -> None:
    arch = next(a for a in ARCHS if a.name == "llama")
    causal = vecpool.Engine(save_hf_model(arch.hf_model(), tmp_path / "c"), device="cpu")
    bidir = vecpool.Engine(
        save_hf_model(arch.hf_model(), tmp_path / "b", is_causal=False), device="cpu"
    )
    assert (causal.defaults.pooler, bidir.defaults.pooler) == ("LAST", "MEAN")


@pytest.mark.parametrize("layout", ["tied", "untied", "base_names"])
@pytest.mark.parametrize("arch", ARCHS, ids=ARCH_IDS)
def test_causal_lm_checkpoints(arch: Arch, layout: str, tmp_path: Path) -> None:
    """`*ForCausalLM` folders load: tied (no lm_head stored), untied (lm_head stored), and
    tied with the base model's unprefixed names, as Qwen3-Embedding-0.6B ships."""
    prompt = random_prompts(VOCAB, [17], seed=6)[0]
    if layout == "base_names":
        hf = arch.hf_model()
        save_hf_model(
            hf, tmp_path, architectures=[arch.causal_lm.__name__], tie_word_embeddings=True
        )
    else:
        hf = arch.hf_model(causal_lm=True, tie_word_embeddings=layout == "tied")
        save_hf_model(hf, tmp_path)
        stored = set(load_file(str(tmp_path / "model.safetensors")))
        assert ("lm_head.weight" in stored) == (layout == "untied")
    engine = vecpool.Engine(tmp_path, device="cpu")
    assert type(engine.model).__name__ == arch.causal_lm.__name__
    ours = engine_hidden(engine, [prompt])[0]
    assert_rel_close(ours, hf_last_hidden(hf, prompt))
    if layout != "base_names":
        with torch.no_grad():
            ref_logits = hf(input_ids=torch.tensor([prompt])).logits[0].numpy()
            logits = engine.model.compute_logits(torch.from_numpy(ours)).numpy()
        assert_rel_close(logits, ref_logits)


@pytest.mark.parametrize(
    "arch", [a for a in ARCHS if a.name in ("qwen3", "gemma2", "qwen2")], ids=lambda a: a.name
)
def test_config_without_layer_types(arch: Arch, tmp_path: Path) -> None:
    """Older configs leave layer_types out: Qwen3 and Qwen2 derive it from max_window_layers,
    Gemma2 slides on the even layers."""
    hf = arch.hf_model()
    folder = save_hf_model(hf, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert "sliding_attention" in config.pop("layer_types")
    (folder / "config.json").write_text(json.dumps(config))
    engine = vecpool.Engine(folder, device="cpu")
    prompt = random_prompts(VOCAB, [30], seed=8)[0]
    assert_rel_close(engine_hidden(engine, [prompt])[0], hf_last_hidden(hf, prompt))


def _edit_checkpoint(
    folder: Path, dest: Path, edit: Callable[[dict[str, torch.Tensor]], None]
) -> Path:
    shutil.copytree(folder, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dest / "model.safetensors"))
    return dest


@pytest.mark.parametrize(
    ("fault", "message"),
    [("missing", "missing tensors"), ("extra", "unexpected tensors"), ("shape", "has shape")],
)
def test_bad_checkpoint_names_the_tensor(
    decoder: Loaded, fault: str, message: str, tmp_path: Path
) -> None:
    name = decoder.arch.own_tensor
    extra = "layers.0.self_attn.extra_proj.weight"

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        if fault == "missing":
            del tensors[name]
        elif fault == "extra":
            tensors[extra] = torch.zeros(2)
        else:
            tensors[name] = torch.zeros(*tensors[name].shape[:-1], tensors[name].shape[-1] + 1)

    folder = _edit_checkpoint(decoder.folder, tmp_path / "bad", edit)
    with pytest.raises(vecpool.ModelLoadError, match=message) as info:
        vecpool.Engine(folder, device="cpu")
    assert (extra if fault == "extra" else name) in str(info.value)


@pytest.mark.parametrize("flag", [{"is_causal": False}, {"use_bidirectional_attention": True}])
def test_bidirectional_config(decoder: Loaded, flag: dict[str, Any], tmp_path: Path) -> None:
    """A config that marks the decoder bidirectional gets non-causal attention, with sliding
    windows reaching both ways, as transformers' `is_causal: false` masks do."""
    folder = save_hf_model(decoder.hf, tmp_path / "bidir", **flag)
    engine = vecpool.Engine(folder, device="cpu")
    assert not engine.model.is_causal
    # transformers honours `is_causal: false` in its masks (not every model reads the other
    # flag; Gemma3 does, with its sliding window narrowed to W // 2 + 1, exclusive).
    reference = flag if decoder.arch.name == "gemma3" else {"is_causal": False}
    hf = type(decoder.hf)(decoder.arch.hf_config(**reference)).eval()
    hf.load_state_dict(decoder.hf.state_dict())
    prompts = random_prompts(VOCAB, LENGTHS, seed=7)
    ours = engine_hidden(engine, prompts)
    causal = engine_hidden(decoder.engine, prompts)
    for prompt, hidden, causal_hidden in zip(prompts, ours, causal, strict=True):
        assert_rel_close(hidden, hf_last_hidden(hf, prompt))
        assert np.abs(hidden - causal_hidden).max() > 1e-3
    # The first token sees the last one.
    changed = [*prompts[1][:-1], prompts[1][-1] % (VOCAB - 1) + 1]
    first = engine_hidden(engine, [prompts[1], changed])
    assert np.abs(first[0][0] - first[1][0]).max() > 1e-3


@pytest.mark.parametrize(
    ("arch", "change", "named"),
    [
        ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        # transformers 4 configs: rope_scaling instead of rope_parameters
        (
            "llama",
            {"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
            "dynamic",
        ),
        (
            "qwen3",
            {"layer_types": ["full_attention", "chunked_attention", "full_attention"]},
            "chunked_attention",
        ),
        ("llama", {"num_key_value_heads": 3}, "num_key_value_heads"),
        ("mistral", {"quantization_config": {"quant_method": "awq"}}, "awq"),
        ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        (
            "qwen3",
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            "partial_rotary_factor",
        ),
        ("gemma2", {"hidden_activation": "swiglu_oai"}, "swiglu_oai"),
        (
            "gemma3",
            {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0}}},
            "yarn",
        ),
        (
            "gemma3",
            {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
            "chunked_attention",
        ),
        ("qwen3", {"hidden_size": None}, "hidden_size"),
    ],
)
def test_unsupported_config_raises(arch: str, change: dict[str, Any], named: str) -> None:
    spec = next(a for a in ARCHS if a.name == arch)
    hf = json.loads(spec.hf_config().to_json_string())
    hf.update(change)
    cls = model_class(spec.base.__name__)
    with pytest.raises(vecpool.ConfigError, match=named), torch.device("meta"):
        cls.from_hf_config(hf)
