"""Strict weight loading: build on the meta device, stream safetensors, name every mismatch."""

from __future__ import annotations

import json
from fnmatch import fnmatchcase
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from vecpool.errors import ModelLoadError
from vecpool.models.base import PoolingModel
from vecpool.models.folder import ModelFolder
from vecpool.models.registry import model_class

_MAX_NAMES = 10
# Weights at least this large load with a progress bar.
PROGRESS_BYTES = 1 << 30


def load_model(folder: ModelFolder, device: torch.device, dtype: torch.dtype) -> PoolingModel:
    """Build the folder's architecture and fill every parameter from its safetensors files."""
    cls = model_class(folder.architecture)
    files = safetensors_files(folder.path)
    hf = folder.hf_config
    if cls.shape_keys:
        hf = {**hf, "checkpoint_shapes": checkpoint_shapes(files, cls.shape_keys)}
    with torch.device("meta"):
        model = cls.from_hf_config(hf)
    model = model.to(dtype=dtype).to_empty(device=device)
    load_safetensors(model, files)
    model.post_load()
    return model.eval().requires_grad_(False)


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


def load_safetensors(model: PoolingModel, files: list[Path]) -> None:
    """Copy every tensor of `files` into `model`; raise naming any missing, unexpected or
    mis-shaped tensor."""
    params = dict(model.named_parameters())
    filled: set[str] = set()
    unexpected: list[str] = []
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
                    name = _parameter_name(model, key, params)
                    if name is None:
                        if not _is_unused(model, key):
                            unexpected.append(f"{key} ({path.name})")
                        continue
                    tensor = f.get_tensor(key)
                    param = params[name]
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise ModelLoadError(
                            f"{path.name}: tensor {key!r} has shape {list(tensor.shape)}, but "
                            f"{type(model).__name__} expects {list(param.shape)} for {name!r}"
                        )
                    with torch.no_grad():
                        param.copy_(tensor)
                    filled.add(name)
                    bar.update(tensor.numel() * tensor.element_size())
    if unexpected:
        raise ModelLoadError(f"unexpected tensors for {type(model).__name__}: {_names(unexpected)}")
    for name, source in model.tied_weights.items():
        if name in params and name not in filled and source in filled:
            with torch.no_grad():
                params[name].copy_(params[source])
            filled.add(name)
    missing = sorted(set(params) - filled)
    for name in [n for n in missing if n in model.optional_parameters]:
        model.drop_parameter(name)
        missing.remove(name)
    if missing:
        raise ModelLoadError(f"missing tensors for {type(model).__name__}: {_names(missing)}")


def _parameter_name(
    model: PoolingModel, key: str, params: dict[str, torch.nn.Parameter]
) -> str | None:
    if key in params:
        return key
    for prefix in model.checkpoint_prefixes:
        if key.startswith(prefix) and key[len(prefix) :] in params:
            return key[len(prefix) :]
    return None


def _is_unused(model: PoolingModel, key: str) -> bool:
    stripped = [key] + [key[len(p) :] for p in model.checkpoint_prefixes if key.startswith(p)]
    return any(fnmatchcase(s, u) for s in stripped for u in model.unused_checkpoint_keys)


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES])
    more = len(names) - _MAX_NAMES
    return f"{shown} (and {more} more)" if more > 0 else shown
