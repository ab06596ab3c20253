"""The C++ CPU kernels build wherever a compiler is present. load_cpu_kernels falls back to the torch
path with only a warning, so without this test a broken kernel source would turn every kernel test
into a skip instead of a failure."""

from __future__ import annotations

import os
import shutil

import pytest

from tokenmill.kernels import load_cpu_kernels


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")
def test_cpu_kernels_build_where_a_compiler_exists() -> None:
    ops = load_cpu_kernels()
    assert ops is not None, "the C++ CPU kernels failed to build (see the warning logged above)"
    cpuinfo = "/proc/cpuinfo"
    if os.path.exists(cpuinfo):
        with open(cpuinfo) as f:
            flags = f.read()
        # with AVX512-BF16 (this project's CI machine) the bf16 kernels are in the build
        assert ops.has_packed_gemv() == ("avx512_bf16" in flags)
