"""Compiling a model's repeated layers with `torch.compile` (regional compilation).

Every architecture here is an input lookup, a stack of identical blocks, and a final norm. Only
the blocks are compiled, each in place: their forward code is shared, so the first block's
graph serves every other one (parameters are graph inputs, not constants), and a 28-layer model
compiles in the time of one layer. The token dimension is dynamic: one graph serves every flat
batch size, so batches need no padding and no per-size warm-up.

Compiling starts after the embedding lookup: a request given as prompt embeds and the same
request given as token ids enter the same compiled graphs with the same rows, which keeps them
bit-exact. What compiling buys is fusion (norms, residual adds, rotary, the gated activation
become one kernel each instead of several) and fewer launches; matrix products stay with the
vendor library.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of the model's layer stacks: each `nn.ModuleList` of at least
    `MIN_STACK` entries of one type (`layers` of a decoder, `encoder.layer` of BERT; a dual
    encoder's or a vision-language model's text and vision towers both), not inside another
    stack's block; where there is none, the one block of a one-entry list (ALBERT's shared
    layer group); empty if it has none."""
    blocks: list[nn.Module] = []
    single: list[nn.Module] = []
    inside: set[int] = set()  # ids of the modules within the blocks taken so far
    for module in model.modules():  # parents before their children
        if id(module) in inside or not isinstance(module, nn.ModuleList):
            continue
        stack = list(module)
        if not stack or len({type(b) for b in stack}) != 1:
            continue
        if len(stack) >= MIN_STACK:
            blocks += stack
            inside.update(id(m) for block in stack for m in block.modules())
        elif not single:
            single = stack
    return blocks or single


# A list of fewer modules is not a layer stack (a pair of heads, a projection's parts).
MIN_STACK = 2


def compile_blocks(model: nn.Module, *, backend: str = "inductor") -> int:
    """Compile each repeated block of `model` in place, with a dynamic token dimension.

    Returns how many blocks were compiled. Compilation itself happens on the first forward
    (tens of seconds on a GPU; the engine warms up once). `backend="eager"` traces without
    generating code, which tests use to check the wrapping on any machine.

    dynamo keeps what it compiled on the code object of the function it traced, with a limit
    of graphs per code object past which it runs that function eagerly, silently. A block
    class's `forward` is one code object for the whole process: every engine of the class
    (an embedder and a reranker, bf16 and FP8 side by side) would add its graphs to one list,
    have its guards checked against the others' on its calls and count towards one limit (a
    7B's engines built after five others once ran at 34.8k tokens/s instead of 59.7k,
    `benchmarks/results/fp8_block_recompile_limit_h200.json`). Each model's blocks therefore run
    a copy of their class's forward with a code object of the model's own: one engine's
    compiled code is its own, whatever else the process holds.
    """
    blocks = repeated_blocks(model)
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    own: dict[Callable[..., Any], types.FunctionType] = {}  # class forward -> this model's copy
    for block in blocks:
        forward = type(block).forward
        if not OWN_CODE:
            block.compile(backend=backend, dynamic=True)
            continue
        if forward not in own:
            own[forward] = own_code(forward)
        block.forward = types.MethodType(own[forward], block)
        block.compile(backend=backend, dynamic=True)
    return len(blocks)


def own_code(function: Callable[..., Any]) -> types.FunctionType:
    """`function` with a code object of its own (equal to the original, not the same object):
    what dynamo compiles for it is kept apart from what it compiled for the original."""
    if not isinstance(function, types.FunctionType):
        raise TypeError(f"cannot copy {function!r}: not a Python function")
    copy = types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__ = function.__qualname__
    copy.__dict__.update(function.__dict__)
    return copy


# False: every model's blocks run their class's forward as is, sharing its compiled code with
# every other model of the class (the baseline of `benchmarks/bench_engines.py --shared-code`).
OWN_CODE = True

# Graphs of one model's block forward that dynamo keeps before it falls back to eager (one
# per structure and kind of step; a model's quantized and plain layers are two structures).
RECOMPILE_LIMIT = 64


# Below this hidden size a step's kernels are too small for fusion to pay: compiled blocks
# cost more host time per call than they save on the device (MiniLM, 384: 35% slower on an
# H200; BERT-base, 768: 5% faster; Qwen3-0.6B, 1024: 1.7x faster).
MIN_COMPILED_HIDDEN_SIZE = 768


def compile_by_default(device: torch.device, hidden_size: int) -> bool:
    """Whether the engine compiles a model unless told: on CUDA, for models wide enough.
    On the CPU the exact padded attention fallback builds per-batch masks, and CI machines
    need no compiler."""
    return device.type == "cuda" and hidden_size >= MIN_COMPILED_HIDDEN_SIZE
