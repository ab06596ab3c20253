"""When the Triton kernels launch with programmatic dependent launch (kernels/triton/common.py): only on a
compiled CUDA device of compute capability 9 or more, and never with TOKENMILL_PDL=0."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.triton import common


def test_pdl_is_off_on_the_cpu() -> None:
    assert not common.use_pdl(torch.device("cpu"))
    assert common.pdl_args(torch.device("cpu")) == {"PDL": False}


@pytest.mark.parametrize("capable", [True, False])
def test_pdl_on_a_capable_gpu_unless_turned_off(capable: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "_pdl_device", lambda index: capable)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TOKENMILL_PDL", raising=False)
    gpu = torch.device("cuda", 0)
    assert common.use_pdl(gpu) is capable
    assert common.pdl_args(gpu) == ({"PDL": True, "launch_pdl": True} if capable else {"PDL": False})
    monkeypatch.setenv("TOKENMILL_PDL", "0")
    assert not common.use_pdl(gpu)
    monkeypatch.delenv("TOKENMILL_PDL")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs no PTX
    assert not common.use_pdl(gpu)
