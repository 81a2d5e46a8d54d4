"""sentence-transformers modules that carry weights: `Dense` projections after pooling (or, in a
multi-vector folder, on every token row). Each loads from its own folder, strictly."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from vecpool.errors import ConfigError, ModelLoadError
from vecpool.models.layers.basic import activation
from vecpool.models.loading.folder import DenseSpec
from vecpool.models.loading.loader import load_module


class Dense(nn.Module):
    """One sentence-transformers `Dense` module: `activation(linear(x))`, in float32."""

    def __init__(self, spec: DenseSpec):
        super().__init__()
        self.linear = nn.Linear(spec.in_features, spec.out_features, bias=spec.bias)
        try:
            self.act = activation(spec.activation)
        except ConfigError as exc:
            raise ModelLoadError(f"{spec.path}: Dense {exc}") from None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        return self.act(self.linear(x))


class DenseStack(nn.Module):
    """The folder's Dense modules in order; no modules: the identity."""

    def __init__(self, layers: Sequence[Dense] = ()):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def output_dim(self, hidden_size: int) -> int:
        if not len(self.layers):
            return hidden_size
        last = self.layers[-1]
        assert isinstance(last, Dense)
        return last.linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out], float32
        for layer in self.layers:
            x = layer(x)
        return x


def load_dense_stack(specs: Sequence[DenseSpec], device: torch.device) -> DenseStack:
    """The Dense modules of `specs`, each filled from its folder's weights, on `device`."""
    layers = []
    for spec in specs:
        dense = Dense(spec)
        load_module(dense, _weights_file(spec.path), f"{spec.path.name} (Dense)")
        layers.append(dense)
    return DenseStack(layers).to(device).eval().requires_grad_(False)


def _weights_file(folder: Path) -> Path:
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (folder / name).is_file():
            return folder / name
    raise ModelLoadError(f"{folder}: Dense module has no model.safetensors or pytorch_model.bin")
