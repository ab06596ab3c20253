"""Builds (once, cached by torch's extension builder) and loads tokenmill's C++ CPU kernels:
paged decode and prefill attention and the fused bf16 elementwise ops.
Returns None where they cannot be built, so callers fall back to their torch path."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)
_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_SOURCES = [os.path.join(_CSRC, name)
            for name in ("paged_decode.cpp", "fused_ops.cpp", "prefill_attention.cpp", "gemv.cpp", "decode_layers.cpp")]
# no -ffast-math: the fused ops must round like the torch reference
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-mprefer-vector-width=512"]
# torch caches a build by name and rebuilds when the sources' paths change, so two checkouts sharing
# one name rebuilt each other's kernels (~30 s at the next start); a name per source directory does not
_NAME = "tokenmill_cpu_kernels_" + hashlib.sha1(_CSRC.encode()).hexdigest()[:10]


@functools.lru_cache(maxsize=1)
def load_cpu_kernels() -> Any:
    try:
        from torch.utils.cpp_extension import load

        load(name=_NAME, sources=_SOURCES, is_python_module=False, verbose=False,
             extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"], extra_include_paths=[_CSRC])
        return torch.ops.tokenmill_cpu
    except Exception as e:  # a missing compiler or ninja: the torch path still works
        logger.warning("C++ CPU kernels unavailable (%s); using the torch attention path", e)
        return None
