"""tokenmill's compiled kernels, all in this package: the C++ CPU kernels under cpu/ (attention, linear,
elementwise, sampling, fused_decode; shared headers in cpu/include) and the one loader that builds them.
The Python attention backends that call them stay in tokenmill.attention."""

from __future__ import annotations

from tokenmill.kernels.loader import load_cpu_kernels

__all__ = ["load_cpu_kernels"]
