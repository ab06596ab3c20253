"""What the Triton kernels share: whether they run under Triton's interpreter (on the CPU, for tests), and
programmatic dependent launch (PDL) on Hopper and later GPUs.

PDL: a kernel launched with it may start while the kernel before it on the stream is still running, once every
program of that one has passed `gdc_launch_dependents` (or exited). A kernel launched so must call `pdl_wait`
before it reads anything an earlier kernel wrote, and before it writes anything; what it does before that may
only read memory no kernel of the step writes (the weights). Every kernel launched with PDL here calls
`gdc_launch_dependents` right after its wait, so each waits on one that finished after its own predecessor did
(`gemv_dot`, not taken by the layers, launches without it). Without PDL (the
CPU, the interpreter, GPUs before sm_90, TOKENMILL_PDL=0) the kernels launch as usual and the PDL branch is
not compiled."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1: kernels run in numpy on the CPU, where bf16 arithmetic is not exact,
    so the kernels compute their products in float32."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _pdl_device(index: int) -> bool:
    major, _ = torch.cuda.get_device_capability(index)
    cuda_ext = getattr(getattr(tl, "extra", None), "cuda", None)
    return major >= 9 and hasattr(cuda_ext, "gdc_wait") and hasattr(cuda_ext, "gdc_launch_dependents")


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: a CUDA device of compute capability 9 or more, compiled
    (not interpreted), and TOKENMILL_PDL not "0"."""
    if device.type != "cuda" or interpreting() or os.environ.get("TOKENMILL_PDL") == "0":
        return False
    return _pdl_device(device.index if device.index is not None else torch.cuda.current_device())


def pdl_args(device: torch.device) -> dict[str, Any]:
    """A kernel's PDL constexpr and, where it is on, the launch option that asks for it."""
    if use_pdl(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Under PDL: wait until the kernel before this one has finished and its writes are visible, then let the
    next kernel launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
