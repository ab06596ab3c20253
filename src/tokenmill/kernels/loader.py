"""Builds (once, cached by torch's extension builder) and loads tokenmill's C++ CPU kernels: every
.cpp under kernels/cpu/ (attention, linear, elementwise, sampling, fused_decode, roofline), compiled
into one library that registers the ops of `torch.ops.tokenmill_cpu`. Returns None where they cannot be built,
so callers fall back to their torch path. This is the only module that compiles C++."""

from __future__ import annotations

import functools
import glob
import hashlib
import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)
_CPU_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu")
_INCLUDE_DIR = os.path.join(_CPU_DIR, "include")
# no -ffast-math: the fused ops must round like the torch reference. -fno-trapping-math changes no value (nothing
# reads the floating-point exception flags); without it GCC 12 vectorizes no loop that calls exp_approx, whose
# clamp it will not turn into min/max instructions, so SiLU-and-mul and the attention softmax ran scalar
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-mprefer-vector-width=512", "-fno-trapping-math"]
# torch caches a build by name and rebuilds when the sources' paths change, so two checkouts sharing
# one name rebuilt each other's kernels (a full rebuild at the next start); a name per source directory does not
_NAME = "tokenmill_cpu_kernels_" + hashlib.sha1(_CPU_DIR.encode()).hexdigest()[:10]


def cpu_sources() -> list[str]:
    """The C++ files of the CPU library, one directory per kind of kernel, in a fixed order."""
    return sorted(glob.glob(os.path.join(_CPU_DIR, "*", "*.cpp")))


@functools.lru_cache(maxsize=1)
def load_cpu_kernels() -> Any:
    try:
        from torch.utils.cpp_extension import load

        load(name=_NAME, sources=cpu_sources(), is_python_module=False, verbose=False,
             extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"], extra_include_paths=[_INCLUDE_DIR])
        return torch.ops.tokenmill_cpu
    except Exception as e:  # a missing compiler or ninja: the torch path still works
        logger.warning("C++ CPU kernels unavailable (%s); using the torch attention path", e)
        return None
