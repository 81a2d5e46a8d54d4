"""Where FP8 pays: per layer form and step size, measured on the device once, so that FP8 only
ever helps.

An FP8 projection quantizes its rows (one kernel, or folded into the norm or the SiLU * up
that writes them) and multiplies through `torch._scaled_mm`. On an H100 at Qwen3-0.6B's sizes
that costs more than the bf16 product up to a few thousand rows and less from ~16k
(`benchmarks/results/fp8_matmul_rows_h100.json`); at Mistral-7B's sizes FP8 pays from ~1k.
Queries of 12 tokens in steps of 256 are ~3k rows. So each form of FP8 layer in the model
(its input and output widths and what writes its rows: a norm, SiLU * up, or plain rows) is
timed through its own forward both ways, FP8 and its weights dequantized to bf16 once, at
power-of-two row counts up to the step budget, each way captured in a CUDA graph (as steps
run; launches are not what is compared), interleaved, the least of three replays kept. The
layer then multiplies in FP8 from the smallest row count at which FP8 was faster there and at
every larger count measured, and below it in bf16 (`Fp8Linear.dense_below`); a form for which
FP8 never won keeps only bf16 steps. A step's path depends on its row count, which a CUDA
graph fixes per token bucket and torch.compile guards, so the choice is recorded with them.

The timings are cached per device, torch and CUDA version and form (`choice_cache`,
`fp8_choice.json`); the same machine makes the same choice on every load. The batch-invariant
mode, whose rows must not depend on the step's size, does not take FP8 at all.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vecpool.models.layers.basic import RMSNorm
from vecpool.models.quant.linear import Fp8GatedMLP, Fp8Linear, Fp8NormLinear
from vecpool.runner import choice_cache

logger = logging.getLogger(__name__)

# Row counts measured, up to the step budget.
ROWS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768)
# Each way's forward is captured this many times in one graph (fewer for large products).
REPEATS = 20
_REPEAT_ELEMENTS = 2**28  # rows x output width past which a graph holds fewer repeats
REPLAYS = 3
CACHE_NAME = "fp8_choice"
CACHE_VERSION = 1
# `benchmarks/lab/fp8_check.py --every-step-fp8` turns it off: every step in FP8 (the baseline).
MEASURED = True
NEVER = 1 << 62  # `fp8_from` of a form FP8 never won: every step in bf16


@dataclass(frozen=True)
class LayerForm:
    """An FP8 projection as its steps see it: widths and what writes its input rows."""

    in_features: int
    out_features: int
    producer: str  # "rows" (quantized on their own), "norm" (RMSNorm), "silu" (SiLU * up)

    def __str__(self) -> str:
        return f"{self.in_features}->{self.out_features} from {self.producer}"


@dataclass
class _Site:
    """One layer of a form, the module whose forward times it, and its norm if any."""

    layer: Fp8Linear
    producer: str
    norm: RMSNorm | None
    layers: list[Fp8Linear]  # every layer of the form


def layer_forms(model: nn.Module) -> dict[LayerForm, _Site]:
    """The model's FP8 projections (per channel; not the block-scaled ones) by form."""
    sites: dict[LayerForm, _Site] = {}
    seen: set[int] = set()

    def add(layer: Fp8Linear, producer: str, norm: RMSNorm | None) -> None:
        if id(layer) in seen:
            return
        seen.add(id(layer))
        form = LayerForm(layer.in_features, layer.out_features, producer)
        sites.setdefault(form, _Site(layer, producer, norm, [])).layers.append(layer)

    for module in model.modules():
        if isinstance(module, Fp8NormLinear) and isinstance(module.linear, Fp8Linear):
            add(module.linear, "norm", module.norm)
        elif (
            isinstance(module, Fp8GatedMLP)
            and module.fused_silu
            and isinstance(module.down_proj, Fp8Linear)
        ):
            add(module.down_proj, "silu", None)
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            add(module, "rows", None)
    return sites


def fp8_from(timings: dict[int, tuple[float, float]]) -> int:
    """The least row count from which FP8 was faster at every count measured (0 where it was
    at all of them, `NEVER` where at none); `timings`: rows -> (bf16 ms, FP8 ms)."""
    start = NEVER
    for rows in sorted(timings, reverse=True):
        bf16, fp8 = timings[rows]
        if fp8 >= bf16:
            break
        start = rows
    return 0 if start == min(timings, default=NEVER) else start


def choose(model: nn.Module, device: torch.device, max_rows: int) -> dict[LayerForm, int]:
    """Measure (or read from the cache) and set where each FP8 layer multiplies in bf16;
    returns each form's `fp8_from`."""
    rows = [r for r in ROWS if r <= max(max_rows, ROWS[0])]
    chosen: dict[LayerForm, int] = {}
    for form, site in layer_forms(model).items():
        if not MEASURED:
            start = 0
        else:
            timings, cached = choice_cache.measured_once(
                choice_cache.cache_path(CACHE_NAME),
                CACHE_VERSION,
                _key(form, site.layer, device, rows),
                _parse,
                lambda site=site: measure(site, device, rows),  # type: ignore[misc]
                lambda t: {str(r): list(ms) for r, ms in t.items()},
            )
            start = fp8_from(timings)
            logger.info(
                "fp8 %s: %s (%s; bf16 / FP8 ms by rows: %s)",
                form,
                "every step in FP8"
                if start == 0
                else "every step in bf16"
                if start == NEVER
                else f"steps of {start} rows or more in FP8, fewer in bf16",
                "cached" if cached else "measured",
                ", ".join(f"{r} {b:.4f}/{f:.4f}" for r, (b, f) in sorted(timings.items())),
            )
        for layer in site.layers:
            layer.dense_below(start)
        chosen[form] = start
    return chosen


def _key(form: LayerForm, layer: Fp8Linear, device: torch.device, rows: list[int]) -> str:
    if device.type == "cuda":
        where = (
            f"{torch.cuda.get_device_name(device)}|cc {torch.cuda.get_device_capability(device)}"
            f"|cuda {torch.version.cuda}"
        )
    else:
        where = device.type
    return (
        f"{where}|torch {torch.__version__}|{form}|{layer.out_dtype}"
        f"|kernels {layer.kernels}|scaled_mm {layer.scaled_mm}|rows {rows}"
    )


def _parse(entry: Any) -> dict[int, tuple[float, float]] | None:
    try:
        return {int(r): (float(ms[0]), float(ms[1])) for r, ms in entry.items()}
    except (AttributeError, TypeError, ValueError, IndexError):
        return None


def measure(site: _Site, device: torch.device, rows: list[int]) -> dict[int, tuple[float, float]]:
    """rows -> (bf16 ms, FP8 ms) of one forward of `site`'s layer, as its steps call it."""
    layer, norm = site.layer, site.norm
    saved = layer.fp8_from, layer.dense_weight
    layer.dense_below(NEVER)  # the dequantized weight, for the bf16 way
    dense_weight = layer.dense_weight
    timings: dict[int, tuple[float, float]] = {}
    try:
        for m in rows:
            width = layer.in_features * (2 if site.producer == "silu" else 1)
            x = torch.randn(m, width, device=device, dtype=layer.out_dtype)
            forward = _forward(site.producer, layer, norm, x)
            repeats = max(1, min(REPEATS, _REPEAT_ELEMENTS // (m * layer.out_features)))
            ways: dict[str, Callable[[], object]] = {}
            for name, start in (("bf16", NEVER), ("fp8", 0)):
                ways[name] = _timed_way(layer, start, dense_weight, forward)
            ms = _time(ways, device, repeats)
            timings[m] = (ms["bf16"], ms["fp8"])
    finally:
        layer.fp8_from, layer.dense_weight = saved
    return timings


def _forward(
    producer: str, layer: Fp8Linear, norm: RMSNorm | None, x: torch.Tensor
) -> Callable[[], object]:
    if producer == "norm" and norm is not None:
        return lambda: layer.norm_forward(x, norm)
    if producer == "silu":
        return lambda: layer.silu_mul_forward(x)
    return lambda: layer(x)


def _timed_way(
    layer: Fp8Linear,
    start: int,
    dense_weight: torch.Tensor | None,
    forward: Callable[[], object],
) -> Callable[[], object]:
    def run() -> object:
        layer.fp8_from, layer.dense_weight = start, dense_weight
        return forward()

    return run


def _time(
    ways: dict[str, Callable[[], object]], device: torch.device, repeats: int
) -> dict[str, float]:
    """Each way's least time per call (ms) over `REPLAYS` interleaved rounds: on CUDA each
    way's `repeats` calls replayed from one CUDA graph, elsewhere called eagerly."""
    if device.type != "cuda":
        best = {name: float("inf") for name in ways}
        for way in ways.values():
            way()  # warm
        for _ in range(REPLAYS):
            for name, way in ways.items():
                begin = time.perf_counter()
                for _ in range(repeats):
                    way()
                best[name] = min(best[name], (time.perf_counter() - begin) * 1e3 / repeats)
        return best
    graphs: dict[str, torch.cuda.CUDAGraph] = {}
    for name, way in ways.items():
        graphs[name] = _capture(way, device, repeats)
    best = {name: float("inf") for name in ways}
    for _ in range(REPLAYS):
        for name, graph in graphs.items():
            # Which path a call takes is fixed in its graph; the layer's attributes only
            # chose it while it was captured.
            first = torch.cuda.Event(enable_timing=True)
            last = torch.cuda.Event(enable_timing=True)
            first.record()
            graph.replay()
            last.record()
            last.synchronize()
            best[name] = min(best[name], first.elapsed_time(last) / repeats)
    return best


def _capture(way: Callable[[], object], device: torch.device, repeats: int) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm (Triton compiles, cuBLAS picks) outside the capture
        way()
        way()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            way()
    return graph


def reset_dense(model: nn.Module) -> None:
    """Every FP8 layer back to FP8 at every step size (the dequantized weights dropped)."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.dense_below(0)
