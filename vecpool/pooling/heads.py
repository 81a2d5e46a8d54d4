"""Heads applied after pooling: sentence-transformers Dense projections, truncation, normalize."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from vecpool.errors import ModelLoadError
from vecpool.models.folder import DenseSpec

_DENSE_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "Identity": nn.Identity,
    "Tanh": nn.Tanh,
    "ReLU": nn.ReLU,
    "GELU": nn.GELU,
    "Sigmoid": nn.Sigmoid,
    "SiLU": nn.SiLU,
}


class DenseStack(nn.Module):
    """The folder's sentence-transformers Dense modules, in order (float32)."""

    def __init__(self, specs: Sequence[DenseSpec]):
        super().__init__()
        self.layers = nn.ModuleList()
        self.activations = nn.ModuleList()
        for spec in specs:
            name = spec.activation.rsplit(".", 1)[-1]
            act = _DENSE_ACTIVATIONS.get(name)
            if act is None:
                raise ModelLoadError(
                    f"{spec.path}: Dense activation {spec.activation!r} is not supported"
                )
            layer = nn.Linear(spec.in_features, spec.out_features, bias=spec.bias)
            _load_dense(layer, spec)
            self.layers.append(layer)
            self.activations.append(act())

    def output_dim(self, hidden_size: int) -> int:
        if not len(self.layers):
            return hidden_size
        last = self.layers[-1]
        assert isinstance(last, nn.Linear)
        return last.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out], float32
        for layer, act in zip(self.layers, self.activations, strict=True):
            x = act(layer(x))
        return x


def _load_dense(layer: nn.Linear, spec: DenseSpec) -> None:
    st_file, bin_file = spec.path / "model.safetensors", spec.path / "pytorch_model.bin"
    if st_file.is_file():
        from safetensors.torch import load_file

        state = load_file(str(st_file))
    elif bin_file.is_file():
        state = torch.load(str(bin_file), map_location="cpu", weights_only=True)
    else:
        raise ModelLoadError(
            f"{spec.path}: Dense module has no model.safetensors or pytorch_model.bin"
        )
    expected = {"linear.weight": layer.weight} | ({"linear.bias": layer.bias} if spec.bias else {})
    unexpected = sorted(set(state) - set(expected))
    missing = sorted(set(expected) - set(state))
    if unexpected or missing:
        raise ModelLoadError(
            f"{spec.path}: Dense weights missing {missing}, unexpected {unexpected}"
        )
    for key, param in expected.items():
        if tuple(state[key].shape) != tuple(param.shape):
            raise ModelLoadError(
                f"{spec.path}: {key} has shape {list(state[key].shape)}, expected {list(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(state[key])


def truncate_and_normalize(
    x: torch.Tensor,  # [n, dim] float32
    dims: torch.Tensor,  # [n] int64: kept leading dimensions per row
    normalize: torch.Tensor,  # [n] bool
) -> torch.Tensor:  # [n, dim]: columns past a row's `dims` are zeroed
    """Matryoshka truncation then L2 normalization, per row, without a Python loop."""
    keep = torch.arange(x.shape[1], device=x.device)[None, :] < dims[:, None]
    x = x * keep
    norms = x.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return torch.where(normalize[:, None], x / norms, x)
