"""Medusa heads (spec_decode/medusa.py): the checkpoint round trip, one clear error for heads that do
not fit the target or the config, and the proposer's chain of drafts from given hidden states."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tokenmill.spec_decode.medusa import (
    MedusaConfig,
    MedusaHeads,
    MedusaProposer,
    load_medusa_heads,
    load_medusa_proposer,
)
from tokenmill.spec_decode.proposer import ProposalInput

HIDDEN, VOCAB, HEADS = 32, 97, 3
TARGET = SimpleNamespace(hidden_size=HIDDEN, vocab_size=VOCAB)


def random_heads(seed: int = 0, layers: int = 2) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(MedusaConfig(HIDDEN, VOCAB, HEADS, layers))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0.0, 0.5)
    return heads.eval()


def spec(model: Path | str, k: int) -> SimpleNamespace:
    return SimpleNamespace(method="medusa", model=str(model), num_speculative_tokens=k)


def proposal(req_ids: list[str], hidden: torch.Tensor | None, max_drafts: list[int] | None = None) -> ProposalInput:
    """A batch carrying hidden states (and the adaptive rule's caps), whether ProposalInput declares
    those fields or not (yet)."""
    args: dict[str, Any] = dict(req_ids=req_ids, token_ids=[[1, 2]] * len(req_ids), num_new_tokens=[1] * len(req_ids))
    batch = ProposalInput(**args)
    batch.hidden_states = hidden  # type: ignore[attr-defined]
    batch.max_drafts = max_drafts  # type: ignore[attr-defined]
    return batch


@pytest.fixture
def saved(tmp_path: Path) -> tuple[MedusaHeads, Path]:
    heads = random_heads()
    heads.save(tmp_path / "heads")
    return heads, tmp_path / "heads"


def test_checkpoint_round_trip(saved: tuple[MedusaHeads, Path]) -> None:
    heads, path = saved
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["num_heads"] == HEADS and config["dtype"] == "bfloat16"
    loaded = load_medusa_heads(path)
    assert loaded.config == heads.config
    for (name, a), (name_b, b) in zip(heads.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert name == name_b and torch.equal(a.to(torch.bfloat16).float(), b), name
    hidden = torch.randn(5, HIDDEN)
    bf16 = random_heads()
    with torch.no_grad():
        for p in bf16.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    assert torch.equal(loaded(hidden), bf16(hidden))


def test_proposer_drafts_the_chain_of_the_first_k_heads_argmaxes(saved: tuple[MedusaHeads, Path]) -> None:
    _, path = saved
    heads = load_medusa_heads(path)
    hidden = torch.randn(4, HIDDEN)
    expected = [[int(heads.lm_head(head(h)).argmax()) for head in heads.heads] for h in hidden]
    assert len({tuple(e) for e in expected}) > 1  # the rows differ: the order of the batch is checked
    for k in range(1, HEADS + 1):
        proposer = load_medusa_proposer(spec(path, k), TARGET)
        assert proposer.needs_hidden_states
        drafts = proposer.propose(proposal(["a", "b", "c", "d"], hidden))
        assert drafts == {rid: e[:k] for rid, e in zip("abcd", expected, strict=True)}
    assert proposer.propose(proposal([], torch.zeros(0, HIDDEN))) == {}


def test_proposer_keeps_to_each_requests_cap(saved: tuple[MedusaHeads, Path]) -> None:
    heads = load_medusa_heads(saved[1])
    hidden = torch.randn(4, HIDDEN)
    chains = heads(hidden).argmax(-1).t().tolist()
    proposer = load_medusa_proposer(spec(saved[1], 2), TARGET)
    drafts = proposer.propose(proposal(list("abcd"), hidden, max_drafts=[0, 1, 3, 2]))
    assert drafts == {"b": chains[1][:1], "c": chains[2][:2], "d": chains[3][:2]}
    assert proposer.propose(proposal(list("abcd"), hidden, max_drafts=[0] * 4)) == {}
    assert proposer.propose(proposal(["a"], None)) == {}


def test_proposer_follows_the_hidden_states_dtype(saved: tuple[MedusaHeads, Path]) -> None:
    proposer = load_medusa_proposer(spec(saved[1], HEADS), TARGET)
    hidden = torch.randn(3, HIDDEN)
    drafts = proposer.propose(proposal(["x", "y", "z"], hidden.to(torch.bfloat16)))
    assert proposer.heads.lm_head.weight.dtype == torch.bfloat16
    assert all(len(d) == HEADS and all(0 <= t < VOCAB for t in d) for d in drafts.values())
    with pytest.raises(ValueError, match="hidden states of shape"):
        proposer.propose(proposal(["x", "y"], hidden))


@pytest.mark.parametrize("target, k, message", [
    (SimpleNamespace(hidden_size=HIDDEN * 2, vocab_size=VOCAB), 2, "hidden_size 32, the target model's is 64"),
    (SimpleNamespace(hidden_size=HIDDEN, vocab_size=VOCAB + 1), 2, "vocab_size 97, the target model's is 98"),
    (TARGET, HEADS + 1, "num_speculative_tokens is 4; these medusa heads propose 1 to 3"),
    (TARGET, 0, "num_speculative_tokens is 0"),
], ids=["hidden_size", "vocab", "k_above_heads", "k_zero"])
def test_heads_that_do_not_fit_are_one_clear_error(saved: tuple[MedusaHeads, Path], target: Any, k: int,
                                                   message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_medusa_proposer(spec(saved[1], k), target)


def test_bad_checkpoints_are_one_clear_error(saved: tuple[MedusaHeads, Path], tmp_path: Path) -> None:
    path = saved[1]
    with pytest.raises(ValueError, match="needs 'model'"):
        load_medusa_proposer(SimpleNamespace(model=None, num_speculative_tokens=1), TARGET)
    with pytest.raises(ValueError, match="cannot read .*config.json"):
        load_medusa_proposer(spec(tmp_path / "nowhere", 1), TARGET)
    config = json.loads((path / "config.json").read_text())
    for change, message in [({"model_type": "llama"}, "not 'medusa'"), ({"num_heads": 0}, "num_heads must be"),
                            ({"num_heads": HEADS + 1}, "has tensors"),
                            ({"num_hidden_layers": 1}, "has tensors"),
                            ({"hidden_size": HIDDEN + 1}, "has shape")]:
        (path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            load_medusa_proposer(spec(path, 1), TARGET)
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="cannot read .*model.safetensors"):
        load_medusa_proposer(spec(path, 1), TARGET)


def test_a_proposer_for_more_tokens_than_heads_is_refused() -> None:
    with pytest.raises(ValueError, match="propose 1 to 3"):
        MedusaProposer(random_heads(), 4)


def test_packed_heads_match_the_module(tmp_path: Path) -> None:
    """The packed path (one stacked layer for the heads' blocks, the lm_head on all k rows) against the
    module in bf16: the same logits up to bf16 rounding, the same drafts where the top two are apart."""
    from tokenmill.kernels import load_cpu_kernels
    from tokenmill.layers.linear import packing_available

    ops = load_cpu_kernels()
    if ops is None or not packing_available():
        pytest.skip("needs the C++ kernels and oneDNN packing")
    heads = random_heads(seed=3, layers=1)
    heads.save(tmp_path / "one")
    proposer = load_medusa_proposer(spec(tmp_path / "one", HEADS), TARGET, ops)
    assert proposer.packed is not None
    assert load_medusa_proposer(spec(tmp_path / "one", HEADS), TARGET).packed is None  # no kernels: the module
    ref_heads = load_medusa_heads(tmp_path / "one").to(torch.bfloat16)
    hidden = torch.randn(6, HIDDEN).to(torch.bfloat16)
    ref = ref_heads(hidden).float()  # [heads, rows, vocab]
    got = proposer.packed.logits(hidden).float()
    assert torch.allclose(got, ref, rtol=2**-6, atol=2e-2 * float(ref.abs().max()))
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 0.05 * float(ref.abs().max())  # [heads, rows]
    drafts = proposer.propose(proposal([str(i) for i in range(6)], hidden))
    expected = ref.argmax(-1).t().tolist()
    for i in range(6):
        for j in range(HEADS):
            if clear[j, i]:
                assert drafts[str(i)][j] == expected[i][j], (i, j)
    assert int(clear.sum()) >= HEADS * 3
    # deeper heads keep the module
    saved_two = random_heads(layers=2)
    saved_two.save(tmp_path / "two")
    assert load_medusa_proposer(spec(tmp_path / "two", 2), TARGET, ops).packed is None


@pytest.mark.parametrize("rows", [1, 6, 20])  # 20: past the widening GEMV's rows, the widened tiles
def test_widened_heads_match_the_module_in_float32(tmp_path: Path, rows: int) -> None:
    """Under a float32 target (an AVX2 CPU): the heads of a bf16 checkpoint kept in bf16 and widened by the C++
    GEMV give the module's float32 logits up to summation order, and its drafts; heads whose weights are not
    bf16 values keep the module."""
    from tokenmill.kernels import load_cpu_kernels

    ops = load_cpu_kernels()
    if ops is None or int(ops.bf16w_gemv_max_rows()) == 0:
        pytest.skip("needs the C++ kernels with the widening bf16 GEMV (AVX2)")
    random_heads(seed=5, layers=1).save(tmp_path / "bf16")  # (saved in bf16)
    proposer = load_medusa_proposer(spec(tmp_path / "bf16", HEADS), TARGET, None, widen_ops=ops)
    assert proposer.packed is not None and proposer.packed.dtype == torch.float32
    assert not proposer.packed.lm_head.packed and proposer.packed.lm_head.weight.dtype == torch.bfloat16
    ref_heads = load_medusa_heads(tmp_path / "bf16")  # float32 in memory
    hidden = torch.randn(rows, HIDDEN)
    ref = ref_heads(hidden)
    got = proposer.packed.logits(hidden)
    assert got.dtype == torch.float32
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-4)
    drafts = proposer.propose(proposal([str(i) for i in range(rows)], hidden))
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 1e-3
    expected = ref.argmax(-1).t().tolist()
    for i in range(rows):
        for j in range(HEADS):
            if clear[j, i]:
                assert drafts[str(i)][j] == expected[i][j], (i, j)
    random_heads(seed=5, layers=1).save(tmp_path / "f32", dtype=torch.float32)
    assert load_medusa_proposer(spec(tmp_path / "f32", HEADS), TARGET, None, widen_ops=ops).packed is None
