"""What the Triton kernels share: whether they run under Triton's interpreter (on the CPU, for tests)."""

from __future__ import annotations

import os


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1: kernels run in numpy on the CPU, where bf16 arithmetic is not exact,
    so the kernels compute their products in float32."""
    return os.environ.get("TRITON_INTERPRET") == "1"
