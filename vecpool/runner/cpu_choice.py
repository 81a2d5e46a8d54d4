"""What the CPU path runs on this machine: the layer stack's linear kernel and how attention
runs, chosen per machine and per model shape from its instruction set and a short measurement.

No CPU class serves as the model for the others. On a Zen 4 and a Xeon with AVX-512 the
prepacked oneDNN linears (`cpu_linear.PackedLinear`) beat the BLAS GEMM behind `F.linear`; on
a 2-core AMD EPYC with AVX2 only they lost to it (111 against 121 inputs/s on MiniLM). How
attention runs a step of mixed lengths (padded to the longest, grouped by length, or one
sequence at a time: `models/layers/cpu_attention.py`) trades a call's fixed cost against
wasted logits, which differs from CPU to CPU too.

So an engine on the CPU measures both, once: each linear shape of its layer stack through
both kernels, what one more group of lengths costs in attention logits (the grouping plans
with it), and one mixed-length step of its attention shape in each way, in interleaved
repetitions (the least time of each kept: other work on the machine only adds time), before
the first step (MiniLM: 7 to 15 s on a 2-core machine at a load average of 8 to 10). The
measurement is cached in the user's cache directory (`cpu_choice.json`), keyed by the CPU's
model name, the instruction set torch dispatches to (`torch.backends.cpu.get_cpu_capability()`,
which honours `ATEN_CPU_CAPABILITY`), the caps given to oneDNN and MKL
(`ONEDNN_MAX_CPU_ISA`, `MKL_ENABLE_INSTRUCTIONS`), torch's version, the thread count, the dtype
and the model's shape: a capped instruction set is another machine. `decide` turns the
instruction set and the measurement into the choice, a pure function: the same machine makes
the same choice on every load. Where the two kernels or the attention ways time within
`TIE` of each other, the instruction set's default stands (oneDNN on AVX-512, the BLAS GEMM
elsewhere; attention by groups).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vecpool.models.layers.attention import AttentionMetadata, flat_attention
from vecpool.models.layers.basic import FusedProjections
from vecpool.models.layers.cpu_attention import (
    CPU_ATTENTION_MODES,
    GROUP_COST_LOGITS,
    bucket_plan,
    bucketed_attention,
)
from vecpool.runner import choice_cache
from vecpool.runner.compiled import repeated_blocks
from vecpool.runner.cpu_linear import PackedLinear, can_pack

logger = logging.getLogger(__name__)

LINEAR_KERNELS = ("onednn", "blas")
# Timings closer than this (relative) are a tie, which the instruction set's default wins.
TIE = 0.05
# Interleaved repetitions of each probe, the least time of each kept: at least `MIN_REPEATS`,
# more while the measurement has taken under `BUDGET_S` seconds (a busy machine gets fewer).
REPEATS = 5
MIN_REPEATS = 2
BUDGET_S = 1.0
# The cache file's format; a file of another version is measured anew.
CACHE_VERSION = 2
# A measurement taken at a load average above this per core is logged as a warning, with how
# to have it taken again: on a busy 2-core machine per-sequence attention timed 1.15 s against
# 0.013 s quiet, and the padded layout won a choice that buckets win by 5x when quiet.
BUSY_LOAD = 1.0


@dataclass(frozen=True)
class CpuChoice:
    """How the CPU runs a model's steps."""

    linear: str  # "onednn": prepacked oneDNN linears; "blas": `F.linear` (the BLAS GEMM)
    attention: str  # "padded", "buckets" or "sequences" (`cpu_attention.CPU_ATTENTION_MODES`)
    # "buckets": what one more group of lengths costs, in logits of one head (`plan_buckets`)
    group_cost: float = GROUP_COST_LOGITS

    def __post_init__(self) -> None:
        if self.linear not in LINEAR_KERNELS:
            raise ValueError(f"linear kernel {self.linear!r}: one of {LINEAR_KERNELS}")
        if self.attention not in CPU_ATTENTION_MODES:
            raise ValueError(f"attention {self.attention!r}: one of {CPU_ATTENTION_MODES}")


@dataclass(frozen=True)
class Measurement:
    """Seconds of one probe under each candidate: the least of `REPEATS` interleaved runs.
    A candidate this machine cannot run (oneDNN for a dtype it does not serve) is absent."""

    linear: dict[str, float]  # kernel -> seconds of the layer stack's linear shapes, once each
    attention: dict[str, float]  # way -> seconds of one mixed-length step's attention
    # One group's fixed cost in logits of one head, from a group of 8 tokens against one of
    # 4 x 128 (`_group_cost`); the attention probes' groups were planned with it.
    group_cost: float = GROUP_COST_LOGITS
    # The machine's 1-minute load average per core when measured (None: not known): above
    # `BUSY_LOAD`, other work took turns with the probes, the many-call ways most.
    load_per_core: float | None = None


@dataclass(frozen=True)
class ProbeShape:
    """What the probes run: the model's linear shapes and its attention's."""

    linears: tuple[tuple[int, int, int], ...]  # (out, in, how many in the stack), sorted
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    max_len: int  # the longest sequence a step may hold

    @classmethod
    def of(cls, model: nn.Module, *, causal: bool, max_len: int) -> ProbeShape:
        """The shape of `model`'s repeated blocks: the linears `pack_linears` would pack, and
        the first attention that names its heads (else heads of 64 over the hidden size)."""
        counts: dict[tuple[int, int], int] = {}
        heads = kv_heads = head_dim = 0
        for block in repeated_blocks(model):
            for module in block.modules():
                weight = getattr(module, "weight", None)
                if type(module) in (nn.Linear, FusedProjections) and weight is not None:
                    out_f, in_f = weight.shape
                    counts[(out_f, in_f)] = counts.get((out_f, in_f), 0) + 1
                num_heads = getattr(module, "num_heads", None)
                if not heads and isinstance(num_heads, int):
                    heads = num_heads
                    kv_heads = int(getattr(module, "num_kv_heads", heads))
                    head_dim = int(getattr(module, "head_dim", 0))
        hidden = int(getattr(model, "hidden_size", 0) or 64)
        if not heads or not head_dim:
            head_dim = 64 if not heads else max(1, hidden // heads)
            heads = kv_heads = heads or max(1, hidden // 64)
        return cls(
            linears=tuple(sorted((o, i, n) for (o, i), n in counts.items())),
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            causal=causal,
            max_len=max_len,
        )


def cpu_isa() -> str:
    """The vector instruction set torch's CPU kernels dispatch to ("AVX512", "AVX2", ...)."""
    return str(torch.backends.cpu.get_cpu_capability())


def default_linear(isa: str) -> str:
    """The linear kernel an instruction set makes the default: oneDNN's prepacked kernels use
    AVX-512's width (and VNNI / bf16 where present); on AVX2 the BLAS GEMM was as fast or
    faster where measured."""
    return "onednn" if isa.upper().startswith(("AVX512", "AMX")) else "blas"


def decide(isa: str, measurement: Measurement | None) -> CpuChoice:
    """The choice for a machine of instruction set `isa` that measured `measurement` (None:
    nothing measured, the instruction set's defaults). Pure: same arguments, same choice."""
    linear = default_linear(isa)
    attention = "buckets"
    group_cost: float = GROUP_COST_LOGITS
    if measurement is not None:
        linear = _fastest(measurement.linear, linear)
        attention = _fastest(measurement.attention, attention)
        group_cost = measurement.group_cost
    return CpuChoice(linear=linear, attention=attention, group_cost=group_cost)


def _fastest(seconds: dict[str, float], default: str) -> str:
    """The fastest candidate, unless the default (when measured) is within `TIE` of it."""
    if not seconds:
        return default
    best = min(sorted(seconds), key=lambda c: seconds[c])
    if default in seconds and seconds[default] <= seconds[best] * (1 + TIE):
        return default
    return best


def machine_key(shape: ProbeShape, dtype: torch.dtype) -> str:
    """The cache key: this machine as the kernels see it (caps included), and the shape."""
    caps = ",".join(
        f"{name}={os.environ.get(name, '')}"
        for name in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
    )
    return " | ".join(
        [
            cpu_model_name(),
            cpu_isa(),
            caps,
            f"torch {torch.__version__}",
            f"threads {torch.get_num_threads()}",
            str(dtype).removeprefix("torch."),
            json.dumps(asdict(shape), sort_keys=True),
        ]
    )


def cpu_model_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_path() -> Path:
    """`$VECPOOL_CACHE_DIR/cpu_choice.json`, else under `$XDG_CACHE_HOME/vecpool` (by default
    `~/.cache/vecpool`)."""
    return choice_cache.cache_path("cpu_choice")


def _parse(entry: Any) -> Measurement | None:
    if not isinstance(entry, dict):
        return None
    try:
        return Measurement(
            linear={str(k): float(v) for k, v in entry["linear"].items()},
            attention={str(k): float(v) for k, v in entry["attention"].items()},
            group_cost=float(entry["group_cost"]),
            load_per_core=None
            if entry.get("load_per_core") is None
            else float(entry["load_per_core"]),
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def read_cached(key: str, path: Path | None = None) -> Measurement | None:
    """The measurement cached under `key`; None if none (or the file is unreadable)."""
    return _parse(choice_cache.read_entries(path or cache_path(), CACHE_VERSION).get(key))


def write_cached(key: str, measurement: Measurement, path: Path | None = None) -> None:
    """Add `measurement` under `key` (the file replaced whole: readers never see half)."""
    choice_cache.write_entry(path or cache_path(), CACHE_VERSION, key, asdict(measurement))


def choose(model: nn.Module, dtype: torch.dtype, *, causal: bool, max_len: int) -> CpuChoice:
    """This machine's choice for `model` (its repeated blocks' shape) in `dtype`: from the
    cached measurement, else measured now and cached. Logged once, at load.

    The first measurement of a machine and shape stands: every later process reads it, so the
    same machine makes the same choice, and a result computed again (a resumed `vecpool embed`,
    a second server process) is the same to the bit. Processes that load the same shape at
    once measure one at a time under a lock on the cache file: the first measures and writes,
    the others read what it wrote. A measurement taken on a busy machine may fix a choice that
    is not the fastest (never an inexact one: every choice is within float32 rounding of the
    others); deleting the cache file has the next load measure again."""
    shape = ProbeShape.of(model, causal=causal, max_len=max_len)
    key = machine_key(shape, dtype)
    start = time.perf_counter()
    measurement, cached = choice_cache.measured_once(
        cache_path(),
        CACHE_VERSION,
        key,
        _parse,
        lambda: measure(model, shape, dtype),
        asdict,
    )
    source = "cached measurement" if cached else f"measured in {time.perf_counter() - start:.2f} s"
    load = measurement.load_per_core
    if load is not None:
        source += f" at a load of {load:.2f} per core"
    isa = cpu_isa()
    choice = decide(isa, measurement)
    busy = load is not None and load > BUSY_LOAD
    logger.log(
        logging.WARNING if busy else logging.INFO,
        "CPU %s (%s, %d threads): linears %s, attention %s (%s: linears %s; attention %s; "
        "a group of lengths costs %.0f logits)%s",
        cpu_model_name(),
        isa,
        torch.get_num_threads(),
        choice.linear,
        choice.attention,
        source,
        _ms(measurement.linear),
        _ms(measurement.attention),
        measurement.group_cost,
        f". Measured on a busy machine, it may not be the fastest here: delete {cache_path()} "
        "to have the next load measure again"
        if busy
        else "",
    )
    return choice


def load_per_core() -> float | None:
    """The 1-minute load average per CPU core; None where the platform has none."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (AttributeError, OSError):
        return None


def _ms(seconds: dict[str, float]) -> str:
    return ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in seconds.items()) or "not measured"


def measure(model: nn.Module, shape: ProbeShape, dtype: torch.dtype) -> Measurement:
    """Time the candidates on this machine: each linear shape of the stack through oneDNN
    (where it serves `dtype`) and `F.linear`, and one mixed-length step's attention in each
    way, interleaved; the least of `REPEATS` runs of each."""
    with torch.inference_mode():
        group_cost = _group_cost(shape, dtype)
        return Measurement(
            linear=_per_kernel(_time_interleaved(_linear_probes(model, shape, dtype))),
            attention=_time_interleaved(_attention_probes(shape, dtype, group_cost)),
            group_cost=group_cost,
            load_per_core=load_per_core(),
        )


def _time_interleaved(probes: dict[str, Callable[[], object]]) -> dict[str, float]:
    """The least seconds of each probe over `MIN_REPEATS` to `REPEATS` rounds (`BUDGET_S`),
    the order rotating per round, after one untimed run of each."""
    names = list(probes)
    if not names:  # nothing of this kind to measure (an int8 stack has no float linears)
        return {}
    best = dict.fromkeys(names, float("inf"))
    begin = time.perf_counter()
    for name in names:
        probes[name]()
    for r in range(REPEATS):
        if r >= MIN_REPEATS and time.perf_counter() - begin > BUDGET_S:
            break
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            probes[name]()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: best[name] for name in names}


# Rows of the linear probe: a small step's worth; fewer for wide layers, so that one probe of
# a 4096 x 12288 projection stays near 0.05 s on one core.
_PROBE_ROWS = 256
_PROBE_ELEMENTS = 2**27


def _linear_probes(
    model: nn.Module, shape: ProbeShape, dtype: torch.dtype
) -> dict[str, Callable[[], object]]:
    """Callables running each distinct linear shape of the stack once through each kernel
    that serves `dtype` here; a shape's time counts as often as the stack holds it."""
    if not shape.linears:
        return {}
    gen = torch.Generator().manual_seed(0)
    cases = []
    for out_f, in_f, count in shape.linears:
        rows = max(16, min(_PROBE_ROWS, _PROBE_ELEMENTS // (out_f * in_f)))
        weight = (torch.randn(out_f, in_f, generator=gen) / in_f**0.5).to(dtype)
        bias = torch.randn(out_f, generator=gen).to(dtype)
        x = torch.randn(rows, in_f, generator=gen).to(dtype)
        cases.append((x, weight, bias, count))
    probes: dict[str, Callable[[], object]] = {}
    for i, (x, weight, bias, count) in enumerate(cases):
        probes[f"blas/{i}/{count}"] = functools.partial(F.linear, x, weight, bias)
        if can_pack(torch.device("cpu"), dtype):
            probes[f"onednn/{i}/{count}"] = functools.partial(PackedLinear(weight, bias), x)
    return probes


def _per_kernel(seconds: dict[str, float]) -> dict[str, float]:
    """The linear probes' seconds summed per kernel, each shape times its count."""
    total: dict[str, float] = {}
    for name, t in seconds.items():
        kernel, _, count = name.split("/")
        total[kernel] = total.get(kernel, 0.0) + t * int(count)
    return total


def probe_lengths(max_len: int) -> list[int]:
    """A mixed step's sequence lengths: sixteen short ones (8 to 64 tokens) and two long ones
    (half of `max_len` and `max_len`, at most 256), fixed so that every machine times the same
    step."""
    longest = max(8, min(max_len, 256))
    short = np.linspace(8, min(64, longest), 16).astype(int).tolist()
    return [longest // 2, *short[:8], longest, *short[8:]]


def _qkv(shape: ProbeShape, dtype: torch.dtype, tokens: int) -> tuple[torch.Tensor, ...]:
    """q, k, v of `tokens` rows in a fused projection's layout (views of one tensor)."""
    heads, kv_heads, dim = shape.heads, shape.kv_heads, shape.head_dim
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    return qkv.view(tokens, heads + 2 * kv_heads, dim).split([heads, kv_heads, kv_heads], 1)


# The group cost's probes: one sequence this short (its cost is the group's fixed cost, nearly
# all), and this many of this length (their logits' cost, nearly all).
_SMALL_GROUP = 8
_LARGE_GROUP = (4, 128)


def _group_cost(shape: ProbeShape, dtype: torch.dtype) -> float:
    """What one more group of lengths costs on this machine, in logits of one head: the time
    of a group of one 8-token sequence over the time a logit takes in 4 sequences of 128."""
    n, length = _LARGE_GROUP
    small = [0, _SMALL_GROUP]
    large = list(range(0, n * length + 1, length))
    probes: dict[str, Callable[[], object]] = {}
    for name, cu in (("small", small), ("large", large)):
        q, k, v = _qkv(shape, dtype, cu[-1])
        plan = bucket_plan(np.array(cu, dtype=np.int64), torch.device("cpu"))
        probes[name] = functools.partial(
            bucketed_attention, q, k, v, plan, causal=shape.causal, scale=1.0
        )
    seconds = _time_interleaved(probes)
    logits = n * length**2 - _SMALL_GROUP**2
    per_logit = max(seconds["large"] - seconds["small"], 1e-9) / logits
    return float(min(max(seconds["small"] / per_logit, 64.0), 1e7))


def _attention_probes(
    shape: ProbeShape, dtype: torch.dtype, group_cost: float
) -> dict[str, Callable[[], object]]:
    """Callables running one mixed step's attention (a fused q/k/v layout) in each way, the
    step's plan built anew each time as a step's first layer builds it."""
    lengths = probe_lengths(shape.max_len)
    q, k, v = _qkv(shape, dtype, sum(lengths))
    dim = shape.head_dim
    cu = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    seq_ids = torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths))
    pos_in_seq = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths]))

    def probe(mode: str) -> Callable[[], object]:
        def run() -> None:
            meta = AttentionMetadata(
                cu_seqlens=torch.from_numpy(cu).to(torch.int32),
                max_seqlen=max(lengths),
                seq_ids=seq_ids,
                pos_in_seq=pos_in_seq,
                use_varlen=False,
                cpu_attention=mode,
                cpu_group_cost=group_cost,
            )
            for _ in range(2):  # two layers of one step: the plan once, used twice
                flat_attention(q, k, v, meta, causal=shape.causal, scale=dim**-0.5)

        return run

    return {mode: probe(mode) for mode in CPU_ATTENTION_MODES}
