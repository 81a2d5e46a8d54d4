"""Strict weight loading: build on the meta device, stream safetensors, name every mismatch."""

from __future__ import annotations

import json
from collections.abc import Callable
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.overrides import TorchFunctionMode
from tqdm.auto import tqdm

from vecpool.config import MODEL_IMPLS
from vecpool.errors import ConfigError, ModelLoadError
from vecpool.models.base import PoolingModel
from vecpool.models.loading.folder import ModelFolder
from vecpool.models.loading.registry import native_class, supported_architectures
from vecpool.models.loading.transformers_fallback import TransformersModel
from vecpool.models.quant.linear import finish_fp8, restore_fp8_dtypes
from vecpool.models.quant.quant_checkpoint import fp8_checkpoint_layers

_MAX_NAMES = 10


class _SkipInit(TorchFunctionMode):
    """The initializers of `torch.nn.init` return their tensor untouched: on the meta device
    they have nothing to fill, and their meta implementations import torch._dynamo (about a
    second at each process start) for nothing."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: object,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else (kwargs or {})["tensor"]
        return func(*args, **(kwargs or {}))


# Weights at least this large load with a progress bar.
PROGRESS_BYTES = 1 << 30


def load_model(
    folder: ModelFolder, device: torch.device, dtype: torch.dtype, model_impl: str = "auto"
) -> PoolingModel:
    """Build the folder's architecture and fill every parameter from its safetensors files.

    Every name is matched from the files' headers before any memory is allocated: a missing,
    unexpected or mis-shaped tensor fails the load before anything is read. `model_impl`
    chooses between the native class and the transformers fallback (`model_class`), which
    loads itself.
    """
    cls = model_class(folder.architecture, model_impl)
    if cls.implementation != "vecpool":
        return cls.from_folder(folder, device, dtype)
    files = safetensors_files(folder.path)
    hf = folder.hf_config
    if cls.shape_keys:
        hf = {**hf, "checkpoint_shapes": checkpoint_shapes(files, cls.shape_keys)}
    with torch.device("meta"), _SkipInit():
        model = cls.from_hf_config(hf)
    stored = _stored_tensors(files)
    fp8_layers = fp8_checkpoint_layers(
        model,
        hf,
        stored,
        lambda key: _parameter_name(model, key, dict(model.named_parameters())),
        dtype,
    )
    # Saved from a head class (or a base model with its names under the prefix).
    prefixed = any(key.startswith(model.checkpoint_prefixes) for key in stored)
    sources = _match_parameters(model, stored, prefixed)
    shared = _check_complete(model, sources, prefixed)
    for name in shared:  # never allocated: it becomes its source once that exists
        _set_parameter(model, name, None)
    model = model.to(dtype=dtype)
    if fp8_layers:
        restore_fp8_dtypes(model)
    model = model.to_empty(device=device)
    for name, source in shared.items():
        _set_parameter(model, name, model.get_parameter(source))
    _copy_tensors(model, files, sources)
    if model.tie_word_embeddings:
        for name, source in model.tied_weights.items():
            param, source_param = model.get_parameter(name), model.get_parameter(source)
            if param is not source_param and torch.equal(param, source_param):
                _set_parameter(model, name, source_param)  # stored twice, equal: one tensor
    model.post_load()
    if fp8_layers:
        finish_fp8(model, device)
    return model.eval().requires_grad_(False)


def model_class(architecture: str, model_impl: str = "auto") -> type[PoolingModel]:
    """The class serving `architecture`: its native class; with `model_impl` "auto" the
    transformers fallback when there is none, with "transformers" the fallback always, with
    "vecpool" a `ConfigError` listing the supported ones when there is none."""
    if model_impl not in MODEL_IMPLS:
        raise ConfigError(f"model_impl {model_impl!r} is not one of {MODEL_IMPLS}")
    native = None if model_impl == "transformers" else native_class(architecture)
    if native is not None:
        return native
    if model_impl == "vecpool":
        raise ConfigError(
            f"architecture {architecture!r} is not supported natively (model_impl="
            f"{model_impl!r}; model_impl='auto' runs it through transformers); supported: "
            f"{', '.join(supported_architectures())}"
        )
    return TransformersModel


def load_module(module: torch.nn.Module, path: Path, what: str) -> None:
    """Fill every parameter of a small module (e.g. a sentence-transformers Dense) from one
    weights file, names as they are: a missing, unexpected or mis-shaped tensor is an error
    naming it. `path` is a .safetensors file, or a .bin read without unpickling code."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    params = dict(module.named_parameters())
    unexpected, missing = sorted(set(state) - set(params)), sorted(set(params) - set(state))
    if unexpected or missing:
        raise ModelLoadError(
            f"{what}: {path.name} has unexpected tensors {unexpected or 'none'} and lacks "
            f"{missing or 'none'}"
        )
    for name, param in params.items():
        if tuple(state[name].shape) != tuple(param.shape):
            raise ModelLoadError(
                f"{what}: {path.name}: tensor {name!r} has shape {list(state[name].shape)}, "
                f"expected {list(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(state[name])


def safetensors_files(root: Path) -> list[Path]:
    """The weight files of a folder: the index's shards if there is one, else every *.safetensors."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / shard for shard in shards]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {root} (other formats are not read)")
    return files


def checkpoint_shapes(files: list[Path], keys: tuple[str, ...]) -> dict[str, list[int]]:
    """The shapes of the tensors named `keys` in `files`, read from their headers only."""
    shapes: dict[str, list[int]] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in set(keys) & set(f.keys()):
                shapes[key] = list(f.get_slice(key).get_shape())
    return shapes


def _stored_tensors(files: list[Path]) -> dict[str, tuple[Path, list[int]]]:
    """Every tensor of `files`: key -> (file, shape), from the headers."""
    stored: dict[str, tuple[Path, list[int]]] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                stored[key] = (path, list(f.get_slice(key).get_shape()))
    return stored


def _match_parameters(
    model: PoolingModel, stored: dict[str, tuple[Path, list[int]]], prefixed: bool
) -> dict[str, str]:
    """parameter name -> the checkpoint key that fills it; raise naming unexpected or
    mis-shaped tensors."""
    params = dict(model.named_parameters())
    prefixes = model.checkpoint_prefixes
    # A base model reading a head class's checkpoint leaves out the head, as transformers does.
    skip_heads = prefixed and not model.capabilities
    sources: dict[str, str] = {}
    unexpected: list[str] = []
    for key, (path, shape) in stored.items():
        name = _parameter_name(model, key, params)
        if name is None:
            if not (_is_unused(model, key) or (skip_heads and not key.startswith(prefixes))):
                unexpected.append(f"{key} ({path.name})")
            continue
        if shape != list(params[name].shape):
            raise ModelLoadError(
                f"{path.name}: tensor {key!r} has shape {shape}, but "
                f"{type(model).__name__} expects {list(params[name].shape)} for {name!r}"
            )
        sources[name] = key
    if unexpected:
        raise ModelLoadError(f"unexpected tensors for {type(model).__name__}: {_names(unexpected)}")
    return sources


def _check_complete(model: PoolingModel, sources: dict[str, str], prefixed: bool) -> dict[str, str]:
    """The tied parameters the checkpoint lacks -> the parameter each shares; drop the optional
    parameters it may lack; raise naming any other parameter it lacks."""
    shared: dict[str, str] = {}
    if model.tie_word_embeddings:
        for name, source in model.tied_weights.items():
            if name not in sources and source in sources:
                shared[name] = source
            elif source not in sources and name in sources:  # transformers ties either way
                shared[source] = name
    missing = sorted({name for name, _ in model.named_parameters()} - set(sources) - set(shared))
    if not prefixed:  # the base model's layout under a head's name
        for name in [n for n in missing if n in model.optional_parameters]:
            model.drop_parameter(name)
            missing.remove(name)
    if missing:
        raise ModelLoadError(f"missing tensors for {type(model).__name__}: {_names(missing)}")
    return shared


def _copy_tensors(model: PoolingModel, files: list[Path], sources: dict[str, str]) -> None:
    """Stream each file's tensors into the parameters `sources` names for them."""
    names = {key: name for name, key in sources.items()}
    total = sum(path.stat().st_size for path in files)
    with tqdm(
        total=total,
        disable=total < PROGRESS_BYTES,
        desc="loading weights",
        unit="B",
        unit_scale=True,
        leave=False,
    ) as bar:
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if key not in names:
                        continue
                    tensor = f.get_tensor(key)
                    with torch.no_grad():
                        model.get_parameter(names[key]).copy_(tensor)
                    bar.update(tensor.numel() * tensor.element_size())


def _set_parameter(model: PoolingModel, name: str, param: torch.nn.Parameter | None) -> None:
    """Make parameter `name` be `param` (shared), or remove it (None)."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if param is None:
        delattr(module, attr)
    else:
        setattr(module, attr, param)


def _parameter_name(
    model: PoolingModel, key: str, params: dict[str, torch.nn.Parameter]
) -> str | None:
    """The parameter `key` fills: after transformers' legacy renames, as it is or without the
    base-model prefix."""
    for old, new in model.checkpoint_renames.items():
        if key.endswith(old):
            key = key[: -len(old)] + new
    candidates = [key] + [key[len(p) :] for p in model.checkpoint_prefixes if key.startswith(p)]
    return next((name for name in candidates if name in params), None)


def _is_unused(model: PoolingModel, key: str) -> bool:
    stripped = [key] + [key[len(p) :] for p in model.checkpoint_prefixes if key.startswith(p)]
    return any(fnmatchcase(s, u) for s in stripped for u in model.unused_checkpoint_keys)


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES])
    more = len(names) - _MAX_NAMES
    return f"{shown} (and {more} more)" if more > 0 else shown
