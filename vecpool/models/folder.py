"""Reading a Hugging Face style model folder, sentence-transformers files included."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vecpool.errors import ModelLoadError

_ST_POOLING_MODES = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_max_tokens": "MAX",
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_sqrt_len_tokens": "MEAN_SQRT_LEN",
    "pooling_mode_weightedmean_tokens": "WEIGHTED_MEAN",
}


@dataclass(frozen=True)
class DenseSpec:
    """One sentence-transformers `Dense` module: a linear projection after pooling."""

    path: Path  # the module's folder
    in_features: int
    out_features: int
    bias: bool
    activation: str  # the torch class path ST stores, e.g. "torch.nn.modules.activation.Tanh"


@dataclass(frozen=True)
class SpladeSpec:
    """A sentence-transformers `SpladePooling` module: how masked-LM logits become one vector.

    Every token's logits go through `log1p(relu(x))` (`"relu"`), or `log1p(log1p(relu(x)))`
    (`"log1p_relu"`), then pool over the sequence by `max` or `sum`. The defaults are
    sentence-transformers' own, used for a `*ForMaskedLM` folder without the module.
    """

    pooling_strategy: str = "max"  # "max" | "sum"
    activation_function: str = "relu"  # "relu" | "log1p_relu"


@dataclass(frozen=True)
class ModelFolder:
    """Everything vecpool reads from a model folder except the weights themselves."""

    path: Path
    hf_config: dict[str, Any]
    architecture: str
    tokenizer_file: Path | None
    tokenizer_config: dict[str, Any] = field(default_factory=dict)
    is_sentence_transformers: bool = False  # modules.json present
    pooling: str | None = None  # one of poolers.SEQUENCE_POOLERS, from 1_Pooling, if any
    dense: tuple[DenseSpec, ...] = ()
    normalize: bool = False  # a Normalize module follows pooling
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    max_seq_length: int | None = None  # sentence_bert_config.json
    splade: SpladeSpec | None = None  # a SpladePooling module, if any

    @classmethod
    def load(cls, path: str | Path) -> ModelFolder:
        root = Path(path)
        if not root.is_dir():
            raise ModelLoadError(f"model folder {str(root)!r} does not exist or is not a folder")
        hf_config = _read_json(root / "config.json", required=True)
        architectures = hf_config.get("architectures") or []
        if not architectures:
            raise ModelLoadError(f"{root / 'config.json'} has no 'architectures' entry")
        tokenizer_file = root / "tokenizer.json"
        folder: dict[str, Any] = {
            "path": root,
            "hf_config": hf_config,
            "architecture": str(architectures[0]),
            "tokenizer_file": tokenizer_file if tokenizer_file.is_file() else None,
            "tokenizer_config": _read_json(root / "tokenizer_config.json"),
        }
        modules = _read_json(root / "modules.json", default=None)
        if modules is not None:
            folder.update(_read_sentence_transformers(root, modules))
        return cls(**folder)


def _read_json(path: Path, *, required: bool = False, default: Any = ...) -> Any:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"the model folder has no {path.name} (looked for {path})")
        return {} if default is ... else default
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None


def _read_sentence_transformers(root: Path, modules: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"is_sentence_transformers": True, "dense": (), "normalize": False}
    dense: list[DenseSpec] = []
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        module_dir = root / str(module.get("path", ""))
        if kind in ("Transformer", "MLMTransformer"):  # the model itself (config.json)
            continue
        if kind == "Pooling":
            out["pooling"] = _read_pooling(module_dir)
        elif kind == "Dense":
            cfg = _read_json(module_dir / "config.json", required=True)
            dense.append(
                DenseSpec(
                    path=module_dir,
                    in_features=int(cfg["in_features"]),
                    out_features=int(cfg["out_features"]),
                    bias=bool(cfg.get("bias", True)),
                    activation=str(
                        cfg.get("activation_function", "torch.nn.modules.linear.Identity")
                    ),
                )
            )
        elif kind == "Normalize":
            out["normalize"] = True
        elif kind == "SpladePooling":
            out["splade"] = _read_splade_pooling(module_dir)
        else:
            raise ModelLoadError(
                f"{root / 'modules.json'}: sentence-transformers module {kind!r} is not supported "
                "(supported: Transformer, MLMTransformer, Pooling, Dense, Normalize, SpladePooling)"
            )
    out["dense"] = tuple(dense)
    st_config = _read_json(root / "config_sentence_transformers.json")
    out["prompts"] = {str(k): str(v) for k, v in (st_config.get("prompts") or {}).items()}
    default_prompt = st_config.get("default_prompt_name")
    if default_prompt is not None and default_prompt not in out["prompts"]:
        raise ModelLoadError(
            f"default_prompt_name {default_prompt!r} is not one of the prompts "
            f"{sorted(out['prompts'])} in config_sentence_transformers.json"
        )
    out["default_prompt_name"] = default_prompt
    if "splade" in out and st_config.get("max_active_dims") is not None:
        raise ModelLoadError(
            f"{root / 'config_sentence_transformers.json'}: max_active_dims (keeping only the "
            "largest weights of each vector) is not supported; ask embed_sparse for top_k instead"
        )
    bert_config = _read_json(root / "sentence_bert_config.json")
    if bert_config.get("max_seq_length") is not None:
        out["max_seq_length"] = int(bert_config["max_seq_length"])
    return out


def _read_pooling(module_dir: Path) -> str:
    cfg = _read_json(module_dir / "config.json", required=True)
    if cfg.get("include_prompt") is False:
        raise ModelLoadError(
            f"{module_dir / 'config.json'}: include_prompt=false (excluding instruction tokens "
            "from pooling) is not supported"
        )
    modes = [mode for key, mode in _ST_POOLING_MODES.items() if cfg.get(key)]
    if len(modes) != 1:
        raise ModelLoadError(
            f"{module_dir / 'config.json'}: expected exactly one pooling mode, found {modes or 'none'}"
        )
    return modes[0]


# SpladePooling's fields: those that set the math, and those that do not change the result.
_SPLADE_CHOICES = {
    "pooling_strategy": ("max", "sum"),
    "activation_function": ("relu", "log1p_relu"),
}
_SPLADE_INERT = ("embedding_dimension", "word_embedding_dimension", "chunk_size")


def _read_splade_pooling(module_dir: Path) -> SpladeSpec:
    path = module_dir / "config.json"
    cfg = _read_json(path)
    unknown = sorted(set(cfg) - set(_SPLADE_CHOICES) - set(_SPLADE_INERT))
    if unknown:
        raise ModelLoadError(f"{path}: SpladePooling field(s) {unknown} are not supported")
    spec = SpladeSpec(**{k: cfg[k] for k in _SPLADE_CHOICES if cfg.get(k) is not None})
    for name, choices in _SPLADE_CHOICES.items():
        if getattr(spec, name) not in choices:
            raise ModelLoadError(
                f"{path}: SpladePooling {name} {getattr(spec, name)!r} is not supported "
                f"(supported: {', '.join(choices)})"
            )
    return spec
