"""Reading a Hugging Face style model folder, sentence-transformers files included."""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vecpool.errors import ModelLoadError
from vecpool.models.architectures.bge_m3 import BgeM3Spec, read_bge_m3

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
class QueryExpansion:
    """ColBERT's query augmentation: a query shorter than `length` tokens is padded up to it with
    `token` (None: the tokenizer's mask token, else its end-of-sequence token); "fixed" also
    makes `length` the query's length limit. The expansion tokens always get output vectors;
    `attend` says whether the tokens of the query attend to them."""

    length: int
    fixed: bool  # sentence-transformers' strategy "fixed" (True) or "min" (False)
    attend: bool
    token: str | None = None


@dataclass(frozen=True)
class SideSpec:
    """How one side (query or document) of a late-interaction model is written, as its files
    say; resolved against the tokenizer when the engine starts."""

    # A marker put right after the first token (ColBERT's [Q] / [D] after [CLS]) when it, or its
    # first word, is one vocabulary token; otherwise it is text in front of the input.
    marker: str | None
    prompt: str  # text in front of the input (after the marker)
    max_tokens: int | None  # the side's length limit (query_length, document_length)
    expansion: QueryExpansion | None  # queries only
    skiplist: bool  # tokens of the skiplist are left out of this side's vectors


@dataclass(frozen=True)
class LateInteractionSpec:
    """A late-interaction (ColBERT-style) folder: how queries and documents are written, and how
    token rows become vectors (per-token Dense projections, skiplist, normalization)."""

    source: str  # the files the settings come from, for messages
    query: SideSpec
    document: SideSpec
    skiplist_words: tuple[str, ...]
    dense: tuple[DenseSpec, ...] = ()  # per-token projections (sentence-transformers Dense)
    normalize: bool = True  # L2-normalize every token vector
    mean_maxsim: bool = False  # score: MaxSim divided by the number of query vectors

    def side(self, input_type: str) -> SideSpec:
        return self.query if input_type == "query" else self.document


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
    pooling: str | None = None  # one of config.SEQUENCE_METHODS, from 1_Pooling, if any
    dense: tuple[DenseSpec, ...] = ()
    normalize: bool = False  # a Normalize module follows pooling
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    max_seq_length: int | None = None  # sentence_bert_config.json
    late_interaction: LateInteractionSpec | None = None  # ColBERT / multi-vector folders
    splade: SpladeSpec | None = None  # a SpladePooling module, if any
    bge_m3: BgeM3Spec | None = None  # colbert_linear.pt / sparse_linear.pt (BGE-M3), if any

    @property
    def image_processor_dir(self) -> Path:
        """Where the image processor's settings (preprocessor_config.json) live."""
        return self.path

    @classmethod
    def load(cls, path: str | Path) -> ModelFolder:
        root = Path(path)
        if not root.is_dir():
            raise ModelLoadError(f"model folder {str(root)!r} does not exist or is not a folder")
        inner = _wrapped_model_dir(root)
        if inner is not None:  # sentence-transformers' CLIP layout: the model in a subfolder
            wrapped = cls.load(inner)
            modules = _read_json(root / "modules.json")
            return replace(wrapped, **_read_sentence_transformers(root, modules))
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
        if folder["architecture"] == "HF_ColBERT":
            folder["late_interaction"] = _read_stanford_colbert(root, hf_config)
        elif modules is not None and _is_multi_vector(root, modules):
            folder.update(_read_multi_vector(root, modules))
            modules = None
        if modules is not None:
            folder.update(_read_sentence_transformers(root, modules))
        if folder.get("late_interaction") is None:
            folder["bge_m3"] = m3 = read_bge_m3(root, folder["tokenizer_config"])
            if m3 is not None and m3.colbert_linear is not None:
                folder["late_interaction"] = _plain_late_interaction(str(m3.colbert_linear))
        return cls(**folder)


def _wrapped_model_dir(root: Path) -> Path | None:
    """The subfolder holding the model, in a sentence-transformers folder whose model module
    lives in one (`0_CLIPModel/` of its CLIP folders) and whose root has no config.json."""
    if (root / "config.json").is_file():
        return None
    modules = _read_json(root / "modules.json", default=None)
    if not isinstance(modules, list) or not modules or not isinstance(modules[0], dict):
        return None
    kind = str(modules[0].get("type", "")).rsplit(".", 1)[-1]
    sub = str(modules[0].get("path", ""))
    if kind in _MODEL_MODULES and sub and (root / sub / "config.json").is_file():
        return root / sub
    return None


def _read_json(path: Path, *, required: bool = False, default: Any = ...) -> Any:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"the model folder has no {path.name} (looked for {path})")
        return {} if default is ... else default
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None


# The sentence-transformers modules that are the model itself (its config.json and weights).
_MODEL_MODULES = ("Transformer", "MLMTransformer", "CLIPModel")


def _read_sentence_transformers(root: Path, modules: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"is_sentence_transformers": True, "dense": (), "normalize": False}
    dense: list[DenseSpec] = []
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        module_dir = root / str(module.get("path", ""))
        if kind in _MODEL_MODULES:  # the model itself (config.json)
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
                "(supported: Transformer, MLMTransformer, CLIPModel, Pooling, Dense, Normalize, "
                "SpladePooling)"
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


# ---- late interaction: HF_ColBERT and sentence-transformers multi-vector folders -----------

# config_sentence_transformers.json keys of PyLate saves (sentence-transformers reads them too).
_PYLATE_KEYS = (
    "query_prefix",
    "document_prefix",
    "query_length",
    "document_length",
    "query_expansion",
    "do_query_expansion",
    "attend_to_expansion_tokens",
    "attend_to_mask_tokens",
    "skiplist_words",
)
_MULTI_VECTOR_MODULES = ("Transformer", "Dense", "MultiVectorMask", "Normalize")


def _module_kind(module: dict[str, Any]) -> str:
    return str(module.get("type", "")).rsplit(".", 1)[-1]


def _is_multi_vector(root: Path, modules: list[dict[str, Any]]) -> bool:
    """A sentence-transformers `MultiVectorEncoder` folder, or a PyLate (ColBERT) one."""
    st_config = _read_json(root / "config_sentence_transformers.json")
    if st_config.get("model_type") in ("MultiVectorEncoder", "ColBERT"):
        return True
    if any(key in st_config for key in _PYLATE_KEYS):
        return True
    return any(_module_kind(m) == "MultiVectorMask" for m in modules)


def _plain_late_interaction(source: str) -> LateInteractionSpec:
    """Queries and documents written alike (no marker, prompt, expansion or skiplist), token
    vectors normalized, MaxSim averaged over the query's vectors: BGE-M3's colbert score."""
    side = SideSpec(marker=None, prompt="", max_tokens=None, expansion=None, skiplist=False)
    return LateInteractionSpec(
        source=source, query=side, document=side, skiplist_words=(), mean_maxsim=True
    )


def _read_stanford_colbert(root: Path, hf: dict[str, Any]) -> LateInteractionSpec:
    """Stanford ColBERT's settings: `artifact.metadata` (its ColBERTConfig, flat or under
    "config"), else the same keys in config.json, else ColBERT's defaults (markers [unused0] /
    [unused1], queries of 32 tokens expanded with [MASK] that is not attended to, punctuation
    left out of documents)."""
    meta = _read_json(root / "artifact.metadata")
    if isinstance(meta.get("config"), dict):
        meta = meta["config"]
    keys = (
        "query_token_id",
        "doc_token_id",
        "query_maxlen",
        "doc_maxlen",
        "mask_punctuation",
        "attend_to_mask_tokens",
        "similarity",
        "interaction",
    )
    cfg = {k: hf[k] for k in keys if hf.get(k) is not None}
    cfg.update({k: meta[k] for k in keys if meta.get(k) is not None})
    source = f"{root / 'artifact.metadata'} / config.json"
    if cfg.get("similarity", "cosine") != "cosine":
        raise ModelLoadError(
            f"{source}: ColBERT similarity {cfg['similarity']!r} is not supported (only 'cosine': "
            "MaxSim of dot products of normalized vectors)"
        )
    if cfg.get("interaction", "colbert") != "colbert":
        raise ModelLoadError(
            f"{source}: ColBERT interaction {cfg['interaction']!r} is not supported (only 'colbert')"
        )
    query_length = _positive_int(cfg.get("query_maxlen", 32), "query_maxlen", source)
    mask_punctuation = bool(cfg.get("mask_punctuation", True))
    return LateInteractionSpec(
        source=source,
        query=SideSpec(
            marker=str(cfg.get("query_token_id", "[unused0]")),
            prompt="",
            max_tokens=query_length,
            expansion=QueryExpansion(
                query_length, fixed=True, attend=bool(cfg.get("attend_to_mask_tokens", False))
            ),
            skiplist=False,
        ),
        document=SideSpec(
            marker=str(cfg.get("doc_token_id", "[unused1]")),
            prompt="",
            max_tokens=_optional_int(cfg.get("doc_maxlen"), "doc_maxlen", source),
            expansion=None,
            skiplist=mask_punctuation,
        ),
        skiplist_words=tuple(string.punctuation) if mask_punctuation else (),
    )


def _read_multi_vector(root: Path, modules: list[dict[str, Any]]) -> dict[str, Any]:
    """A multi-vector folder as sentence-transformers 6 loads it: its own saves (model_type
    "MultiVectorEncoder": Transformer, per-token Dense, MultiVectorMask, Normalize) as they are;
    PyLate saves (top-level query_prefix, query_length, ... in config_sentence_transformers.json)
    with a MultiVectorMask (PyLate's punctuation skiplist by default) and Normalize added."""
    st_path = root / "config_sentence_transformers.json"
    st_config = _read_json(st_path)
    native = st_config.get("model_type") == "MultiVectorEncoder"
    transformers = [m for m in modules if _module_kind(m) == "Transformer"]
    if len(transformers) != 1:
        raise ModelLoadError(f"{root / 'modules.json'}: expected one Transformer module")
    dense: list[DenseSpec] = []
    mask: dict[str, Any] | None = None
    normalize = not native  # PyLate saves normalize inline; sentence-transformers adds a module
    for module in modules:
        kind, module_dir = _module_kind(module), root / str(module.get("path", ""))
        if kind == "Dense":
            dense.append(_dense_spec(module_dir))
        elif kind == "MultiVectorMask":
            mask = _read_json(module_dir / "config.json")
        elif kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            continue  # it makes sentence embeddings: no part of the token vectors
        elif kind not in _MULTI_VECTOR_MODULES:
            raise ModelLoadError(
                f"{root / 'modules.json'}: module {kind!r} of a multi-vector folder is not "
                f"supported (supported: {', '.join(_MULTI_VECTOR_MODULES)})"
            )
    prefixes = {
        side: str(st_config[key] or "")
        for side, key in (("query", "query_prefix"), ("document", "document_prefix"))
        if key in st_config
    }
    if mask is None and not native:
        words = st_config.get("skiplist_words")
        if words is None:  # PyLate's default
            legacy = prefixes or st_config.get("model_type") == "ColBERT"
            words = list(string.punctuation) if legacy else []
        mask = {"skiplist_words": words}
    skip_sides = _skiplist_sides(mask, st_path)
    transformer_dir = root / str(transformers[0].get("path", ""))
    knobs = _transformer_knobs(st_config, transformer_dir / "sentence_bert_config.json")
    source = f"{st_path} / {transformer_dir / 'sentence_bert_config.json'}"
    expansion = _query_expansion(knobs.get("query_expansion"), source)
    query_length = _optional_int(knobs.get("query_length"), "query_length", source)
    if expansion is not None and query_length is not None and query_length < expansion.length:
        raise ModelLoadError(
            f"{source}: query_length={query_length} is below the query expansion length "
            f"{expansion.length}"
        )
    if expansion is not None and mask is None and not expansion.attend:
        # Without a MultiVectorMask nothing scores tokens that are not attended to: the
        # expansion then changes no output, as in sentence-transformers.
        expansion = None
    prompts = {str(k): str(v or "") for k, v in (st_config.get("prompts") or {}).items()}

    def side(name: str, max_tokens: int | None, side_expansion: QueryExpansion | None) -> SideSpec:
        prefix = prefixes.get(name)
        return SideSpec(
            marker=prefix or None,
            prompt=prompts.get(name, "").removeprefix(prefix or ""),
            max_tokens=max_tokens,
            expansion=side_expansion,
            skiplist=name in skip_sides,
        )

    spec = LateInteractionSpec(
        source=source,
        query=side(
            "query", expansion.length if expansion and expansion.fixed else query_length, expansion
        ),
        document=side(
            "document",
            _optional_int(knobs.get("document_length"), "document_length", source),
            None,
        ),
        skiplist_words=tuple(str(w) for w in (mask or {}).get("skiplist_words") or ()),
        dense=tuple(dense),
        normalize=normalize,
        mean_maxsim=st_config.get("similarity_fn_name") == "meanmaxsim",
    )
    out = _read_sentence_transformers(root, transformers)
    out["late_interaction"] = spec
    return out


def _skiplist_sides(mask: dict[str, Any] | None, source: Path) -> frozenset[str]:
    if mask is None:
        return frozenset()
    if mask.get("keep_only_token_ids"):
        raise ModelLoadError(
            f"{source}: MultiVectorMask keep_only_token_ids (image-patch documents) is not supported"
        )
    sides = mask.get("skiplist_tasks")
    if sides is None:
        sides = ["document"]
    elif isinstance(sides, str):
        sides = [sides]
    return frozenset(str(s) for s in sides) if mask.get("skiplist_words") else frozenset()


def _transformer_knobs(st_config: dict[str, Any], transformer_config: Path) -> dict[str, Any]:
    """query_length, document_length and query_expansion: the Transformer module's own config,
    else PyLate's top-level keys (with its default of expanding queries to 32 tokens)."""
    knobs: dict[str, Any] = {
        key: st_config[key]
        for key in ("query_length", "document_length", "query_expansion")
        if key in st_config and (st_config[key] is not None or key == "query_expansion")
    }
    if "query_expansion" not in knobs and any(key in st_config for key in _PYLATE_KEYS):
        if st_config.get("do_query_expansion") is False:
            knobs["query_expansion"] = None
        else:
            attend = st_config.get(
                "attend_to_expansion_tokens", st_config.get("attend_to_mask_tokens")
            )
            length = knobs.pop("query_length", None) or 32
            knobs["query_expansion"] = {
                "strategy": "fixed",
                "attend": bool(attend),
                "length": length,
            }
    saved = _read_json(transformer_config)
    knobs.update(
        {k: saved[k] for k in ("query_length", "document_length", "query_expansion") if k in saved}
    )
    return knobs


def _query_expansion(value: Any, source: str) -> QueryExpansion | None:
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("strategy") not in ("fixed", "min"):
        raise ModelLoadError(
            f"{source}: query_expansion must be null or have strategy 'fixed' or 'min', got {value!r}"
        )
    attend = value.get("attend", False)
    token = value.get("token")
    if not isinstance(attend, bool) or not (token is None or isinstance(token, str)):
        raise ModelLoadError(f"{source}: query_expansion has an invalid attend or token: {value!r}")
    return QueryExpansion(
        length=_positive_int(value.get("length"), "query_expansion length", source),
        fixed=value["strategy"] == "fixed",
        attend=attend,
        token=token,
    )


def _dense_spec(module_dir: Path) -> DenseSpec:
    cfg = _read_json(module_dir / "config.json", required=True)
    if cfg.get("use_residual"):
        raise ModelLoadError(
            f"{module_dir / 'config.json'}: a Dense module with use_residual is not supported"
        )
    return DenseSpec(
        path=module_dir,
        in_features=int(cfg["in_features"]),
        out_features=int(cfg["out_features"]),
        bias=bool(cfg.get("bias", True)),
        activation=str(cfg.get("activation_function", "torch.nn.modules.linear.Identity")),
    )


def _optional_int(value: Any, name: str, source: str) -> int | None:
    return None if value is None else _positive_int(value, name, source)


def _positive_int(value: Any, name: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"{source}: {name} must be a positive integer, got {value!r}")
    return value


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
