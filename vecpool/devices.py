"""The machine's devices, asked without loading torch where torch is not loaded yet.

The server's launcher places engines (one per CUDA device, or several sharing the CPU's cores)
before any process has loaded torch, and it never needs to. Where torch is already loaded (an
engine process, an offline `Engine`) its answers are used, so they agree with what the engine
will see; elsewhere the CUDA driver is asked directly (`cuDeviceGetCount`, which honours
`CUDA_VISIBLE_DEVICES` as torch does), and the CPU's threads are the cores this process may run
on (`OMP_NUM_THREADS` when set, as torch reads it).
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any


def cuda_device_count() -> int:
    """CUDA devices this process can use (0 without a driver or a device)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return int(torch.cuda.device_count())
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def device_type(device: Any) -> str:
    """ "cuda" or "cpu" (or another torch device type) of `device` (a name like "cuda:1", a torch
    device, or None: CUDA when the machine has a device, else the CPU)."""
    if device is None:
        return "cuda" if cuda_device_count() > 0 else "cpu"
    if not isinstance(device, str):
        return str(device.type)
    return device.split(":", 1)[0]


def device_index(device: Any) -> int | None:
    """The number of a numbered device ("cuda:1": 1), else None."""
    if device is None:
        return None
    if not isinstance(device, str):
        return device.index
    _, _, index = device.partition(":")
    return int(index) if index.isdigit() else None


def cpu_threads() -> int:
    """Compute threads of this process's CPU work: torch's count where it is loaded."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return int(torch.get_num_threads())
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    return len(os.sched_getaffinity(0))
