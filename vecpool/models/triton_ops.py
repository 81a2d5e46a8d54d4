"""vecpool's Triton kernels as operators the compiler can see into.

Each kernel is the body of a `torch.library.triton_op`: called eagerly, the op launches the
kernel as Triton does; inside a compiled layer the compiler traces the op's Python (its output
allocations and the launch, through `torch.library.wrap_triton`) and launches the kernel from
its own generated code, as it launches the kernels it writes. An opaque custom op is instead
called through the dispatcher and a Python wrapper every time: on an H200 host, 28 launches of
the FP8 RMSNorm in a compiled function cost the host 2.5-3.2 ms that way against 0.9 ms as a
`triton_op` (`benchmarks/results/triton_op_launch_h200.json`), and a 28-layer decoder makes six
such calls a layer.

A kernel called from a compiled layer gets its float scalars as 64-bit floats: each kernel
casts them to float32 first (`tl.cast`), which is what Triton's own launcher passes, so the
two launches compute the same bits.
"""

from __future__ import annotations

from typing import Any

import torch


def launcher(kernel: Any) -> Any:
    """`kernel` to be launched (`launcher(kernel)[grid](...)`) from the body of a
    `triton_op`: traced by the compiler inside compiled layers, launched as it is otherwise.
    Triton's interpreter (the CPU tests) launches it as it is, except on fake tensors (the
    compiler working out the outputs' shapes), where there is nothing to run."""
    from torch._guards import detect_fake_mode
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return torch.library.wrap_triton(kernel)
    return _NotRun() if detect_fake_mode() is not None else kernel


class _NotRun:
    """A launch that does nothing: `_NotRun()[grid](*args, **kwargs)`."""

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: None
