"""What a tensor-parallel rank takes of a checkpoint tensor, which KV heads it holds, and the
vocabulary-parallel embedding's lookup, checked rank by rank in one process (the collectives
themselves run in tests/models/test_golden_tp.py)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.distributed import TensorParallel
from tokenmill.layers.linear import MergedLinear, QKVLinear, RowParallelLinear, UnquantizedLinearMethod
from tokenmill.layers.parallel import CheckpointSlice, VocabParallelEmbedding, equal_slice, padded_slice


def test_slices_narrow_rows_and_columns_and_pad() -> None:
    t = torch.arange(24.0).view(6, 4)
    assert torch.equal(CheckpointSlice(0, 2, 2).take(t), t[2:4])
    assert torch.equal(CheckpointSlice(1, 2, 2).take(t), t[:, 2:4])
    bias = torch.arange(6.0)
    assert torch.equal(CheckpointSlice(1, 2, 2).take(bias), bias)  # a row-parallel layer's bias: whole
    padded = padded_slice(6, TensorParallel(3, 4)).take(t)  # rows 6 and 7 are past the end: zeros
    assert padded.shape == (2, 4) and not padded.any()
    last = padded_slice(7, TensorParallel(3, 4)).take(torch.ones(7, 2))
    assert torch.equal(last, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    assert equal_slice(8, TensorParallel(1, 2)) == CheckpointSlice(0, 4, 4)
    with pytest.raises(ValueError, match="not divisible by the tensor parallel size 3"):
        equal_slice(8, TensorParallel(0, 3))


@pytest.mark.parametrize(("kv", "size", "expected"), [
    (4, 2, [(0, 2), (2, 2)]),  # a share each
    (2, 4, [(0, 1), (0, 1), (1, 1), (1, 1)]),  # replicated over the ranks whose query heads share it
    (1, 2, [(0, 1), (0, 1)]),
    (8, 8, [(r, 1) for r in range(8)]),
])
def test_kv_heads(kv: int, size: int, expected: list[tuple[int, int]]) -> None:
    assert [TensorParallel(r, size).kv_heads(kv) for r in range(size)] == expected


def test_qkv_rank_loads_its_heads() -> None:
    # 4 query heads, 2 KV heads, head_dim 2, over 4 ranks: rank 3 holds query head 3 and KV head 1
    q, k, v = (torch.randn(n * 2, 3) for n in (4, 2, 2))
    layer = QKVLinear(3, 2, 4, 2, False, torch.float32, UnquantizedLinearMethod(pack=False), TensorParallel(3, 4))
    for shard, t in zip("qkv", (q, k, v), strict=True):
        layer.weight_loader(layer.weight, t, shard)
    assert torch.equal(layer.weight, torch.cat([q[6:8], k[2:4], v[2:4]]))
    assert not layer.missing_weights()


def test_merged_and_row_parallel_take_their_share() -> None:
    method = UnquantizedLinearMethod(pack=False)
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    merged = MergedLinear(3, [8, 8], False, torch.float32, method, TensorParallel(1, 2))
    merged.weight_loader(merged.weight, gate, 0)
    merged.weight_loader(merged.weight, up, 1)
    assert torch.equal(merged.weight, torch.cat([gate[4:], up[4:]]))
    down = torch.randn(3, 8)
    row = RowParallelLinear(8, 3, False, torch.float32, method, TensorParallel(1, 2))
    row.weight_loader(row.weight, down, None)
    assert torch.equal(row.weight, down[:, 4:]) and row.input_size == 4
    with pytest.raises(ValueError, match="row-parallel linear layer with a bias"):
        RowParallelLinear(8, 3, True, torch.float32, method, TensorParallel(1, 2))


class _Summed(TensorParallel):
    """A rank whose all_reduce is left to the test (which sums the ranks' outputs itself)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_vocab_parallel_embedding_ranks_sum_to_the_lookup() -> None:
    table = torch.randn(7, 5)  # 7 rows over 2 ranks: 4 each, the last one padded
    ids = torch.tensor([0, 3, 4, 6, 2])
    parts = []
    for rank in range(2):
        emb = VocabParallelEmbedding(7, 5, _Summed(rank, 2))
        emb.weight_loader(emb.weight, table)
        parts.append(emb(ids))
    assert torch.equal(parts[0] + parts[1], table[ids])
