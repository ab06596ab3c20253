"""bf16 weights kept in bf16 under a float32 model (a CPU without bf16 arithmetic, dtype auto): the C++ product
over them stored in panels (bf16p_gemm, AVX2), the C++ GEMV that widens them as loaded (bf16w_gemv), the C++
product past its rows (bf16w_gemm) and the tiled torch product equal F.linear over the widened weight to float32
rounding, in a layer too; the engine config chooses that storage only for a bf16 checkpoint that dtype auto runs
in float32 on such a CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tokenmill.config as config
import tokenmill.layers.linear as linear
from tests.fixtures import build_model
from tokenmill.bench.model_math import ModelCost
from tokenmill.config import EngineArgs
from tokenmill.kernels import load_cpu_kernels
from tokenmill.layers.linear import Linear, UnquantizedLinearMethod, widened_linear
from tokenmill.metrics.step_cost import model_cost
from tokenmill.worker.worker import Worker

DEMO = str(Path(__file__).resolve().parents[2] / "models" / "tokenmill-demo")  # a bf16 checkpoint
OPS = load_cpu_kernels()
HAS_GEMV = OPS is not None and int(OPS.bf16w_gemv_max_rows()) > 0


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(not HAS_GEMV, reason="the C++ kernels with AVX2/FMA are not built here")
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 9, 13, 16, 64])  # over 8: weight rows in pairs
@pytest.mark.parametrize("k", [7, 64, 300])
def test_bf16w_gemv_matches_linear_over_the_widened_weight(rows: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + k)
    w = torch.randn(37, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(37, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    close(OPS.bf16w_gemv(x, w, b), F.linear(x, w.float(), b))
    close(OPS.bf16w_gemv(x, w, None), F.linear(x, w.float()))
    with pytest.raises(RuntimeError, match="rows"):
        OPS.bf16w_gemv(torch.randn(65, k), w, None)


@pytest.mark.skipif(not HAS_GEMV, reason="the C++ kernels with AVX2/FMA are not built here")
# rows: whole and partial 6-row strips, past one 192-row block; n: whole and partial 16-column panels;
# k: none, under a vector, a vector's tail, past one 256-wide block with a tail
@pytest.mark.parametrize(("rows", "n", "k"), [(0, 16, 64), (1, 1, 1), (5, 37, 7), (6, 16, 8), (17, 33, 300),
                                              (200, 48, 520), (64, 130, 1029), (3, 0, 64), (4, 5, 0)])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16w_gemm_matches_linear_over_the_widened_weight(rows: int, n: int, k: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen)
    x = torch.randn(rows, k + 3, generator=gen)[:, 1:k + 1]  # rows strided past k
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for bias in (b, None):  # against the float64 product: float32 sums of up to 1,029 terms round apart
            want = F.linear(x.double(), w.double(), None if bias is None else bias.double()).float()
            torch.testing.assert_close(OPS.bf16w_gemm(x, w, bias), want, rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="bf16"):
        OPS.bf16w_gemm(x, w.float(), None)


@pytest.mark.skipif(not HAS_GEMV, reason="the C++ kernels with AVX2/FMA are not built here")
# rows: none, one (two k a step: odd K leaves a tail), whole and partial 6-row strips, past one 192-row block;
# n: one panel and several; k: none, one, under a vector, past one 256-wide slice with a tail
@pytest.mark.parametrize(("rows", "n", "k"), [(0, 16, 64), (1, 16, 1), (1, 48, 301), (2, 32, 7), (6, 16, 8),
                                              (17, 64, 300), (200, 48, 520), (64, 128, 1029), (3, 0, 64), (4, 16, 0)])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16p_gemm_over_panels_matches_linear_over_the_widened_weight(rows: int, n: int, k: int,
                                                                       threads: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen)
    x = torch.randn(rows, k + 3, generator=gen)[:, 1:k + 1]  # rows strided past k
    panels = linear.bf16_panels(w)
    assert panels.shape == (n // 16, k, 16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for bias in (b, None):  # against the float64 product, as bf16w_gemm's
            want = F.linear(x.double(), w.double(), None if bias is None else bias.double()).float()
            torch.testing.assert_close(OPS.bf16p_gemm(x, panels, bias), want, rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="panels"):
        OPS.bf16p_gemm(x, w, None)  # a weight as loaded is not panels


def test_bf16_panels_layout() -> None:
    # panel p, k, 32-bit word i: column 16p + i in its low half, 16p + 8 + i in its high half
    w = torch.arange(32 * 3, dtype=torch.float32).view(32, 3).to(torch.bfloat16)
    panels = linear.bf16_panels(w)
    for p in range(2):
        for k in range(3):
            for i in range(8):
                assert panels[p, k, 2 * i] == w[16 * p + i, k] and panels[p, k, 2 * i + 1] == w[16 * p + 8 + i, k]
    with pytest.raises(ValueError, match="multiple of 16"):
        linear.bf16_panels(w[:20])


@pytest.mark.skipif(not HAS_GEMV, reason="the C++ kernels with AVX2/FMA are not built here")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("n", "k"), [(16, 1), (32, 7), (48, 8), (64, 300), (256, 1024)])  # k past and short of 8
def test_panels_rearranged_in_place_match_bf16_panels(n: int, k: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    want = linear.bf16_panels(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        own = w.clone()
        got = linear.PanelGemm(OPS).panels(own)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, want) and got.data_ptr() == own.data_ptr()  # the same storage, rewritten
    # a weight that is a view of another tensor (here a slice of a larger one) is copied, never rewritten
    big = torch.cat([w, w]).clone()
    view = big[n:]
    assert torch.equal(linear.PanelGemm(OPS).panels(view), want) and torch.equal(big[n:], w)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        OPS.bf16_panels_(w[:n - 8].clone())


def test_embedding_reads_a_tied_lm_heads_panels() -> None:
    gen = torch.Generator().manual_seed(3)
    table = torch.randn(48, 24, generator=gen).to(torch.bfloat16)
    embed = linear.Embedding(48, 24, torch.bfloat16, torch.float32)
    embed.weight.data.copy_(table)
    ids = torch.tensor([[0, 7, 8, 15], [16, 31, 40, 47]])
    want = embed(ids)
    embed.take_panels(torch.nn.Parameter(linear.bf16_panels(table), requires_grad=False))
    assert embed.weight.dim() == 3 and embed(ids).dtype == torch.float32  # (read from the panels)
    assert torch.equal(embed(ids), want) and torch.equal(want, table[ids].float())
    with pytest.raises(IndexError, match="out of range"):
        embed(torch.tensor([48]))
    with pytest.raises(ValueError, match="do not hold"):
        embed.take_panels(torch.nn.Parameter(linear.bf16_panels(table[:32]), requires_grad=False))


def test_widened_linear_a_tile_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear, "WIDEN_TILE_BYTES", 4 * 50 * 16)  # tiles of 16 features: 45 takes three
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(45, 50, generator=gen).to(torch.bfloat16), torch.randn(45, generator=gen)
    x = torch.randn(20, 50, generator=gen)
    close(widened_linear(x, w, b), F.linear(x, w.float(), b))


@pytest.mark.parametrize("rows", [0, 1, 5, 33])
@pytest.mark.parametrize("bf16_packs", [False, True], ids=["no-bf16-path", "bf16-path"])
# 48 output features: whole panels (bf16_panels' layout, bf16p_gemm for every row count); 40: kept as loaded
@pytest.mark.parametrize("n", [40, 48])
def test_layer_keeps_bf16_weights_and_multiplies_in_float32(monkeypatch: pytest.MonkeyPatch, rows: int,
                                                            bf16_packs: bool, n: int) -> None:
    # where oneDNN could pack bf16 (the engine does not choose this storage there), the weights stay unpacked
    monkeypatch.setattr(linear, "packing_available", lambda: bf16_packs)
    method = UnquantizedLinearMethod(weight_dtype=torch.bfloat16, widen_ops=OPS if HAS_GEMV else None)
    layer = Linear(64, n, True, torch.float32, method)
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(n, 64, generator=gen).to(torch.bfloat16), torch.randn(n, generator=gen)
    layer.weight_loader(layer.weight, w)
    assert layer.bias is not None
    layer.weight_loader(layer.bias, b)
    method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.bfloat16 and layer.bias.dtype == torch.float32 and not layer.packed
    panels = HAS_GEMV and n % 16 == 0
    assert isinstance(layer.gemv_ops, linear.PanelGemm) == panels
    assert layer.weight.shape == ((n // 16, 64, 16) if panels else (n, 64))
    calls: list[int] = []
    if panels:
        product = layer.gemv_ops.packed_gemv
        monkeypatch.setattr(layer.gemv_ops, "packed_gemv", lambda *args: calls.append(1) or product(*args))
    elif method.widen_gemv is not None:  # past the GEMV's rows, the C++ product (without it, widened tiles)
        gemm = method.widen_gemv.gemm
        monkeypatch.setattr(method.widen_gemv, "gemm", lambda *args: calls.append(1) or gemm(*args))
    x = torch.randn(2, rows, 64, generator=gen)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (2, rows, n)
    close(y, F.linear(x, w.float(), b))
    assert len(calls) == (1 if panels or (HAS_GEMV and 2 * rows > 16) else 0)


@pytest.mark.parametrize(("runs_bf16", "dtype", "want"), [(False, "auto", "bfloat16"), (True, "auto", None),
                                                          (False, "float32", None)])
def test_the_config_keeps_bf16_weights_only_where_auto_falls_back_to_float32(
        monkeypatch: pytest.MonkeyPatch, runs_bf16: bool, dtype: str, want: str | None) -> None:
    monkeypatch.setattr(config, "cpu_runs_bf16", lambda: runs_bf16)
    cfg = EngineArgs(model=DEMO, dtype=dtype, device="cpu").create_engine_config()
    assert cfg.model.linear_weight_dtype == want
    assert cfg.model.dtype == ("bfloat16" if runs_bf16 and dtype == "auto" else "float32")


@pytest.mark.parametrize("name", ["llama-gqa4-untied", "llama-gqa2-tied"])
def test_model_cost_counts_the_bf16_weights(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: str,
                                            monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """The bytes a loaded model holds, and MBU's bytes a step, count the bf16 projections, embedding and lm_head
    at 2 bytes, the rest at float32's 4."""
    monkeypatch.setattr(config, "cpu_runs_bf16", lambda: False)
    d = build_model(name, str(tmp_path_factory.mktemp("bf16") / name), tokenizer_dir, dtype="bfloat16")
    cfg = EngineArgs(d, kv_cache_memory="8MiB").create_engine_config()
    assert cfg.model.linear_weight_dtype == "bfloat16"
    worker = Worker(cfg)
    cost = model_cost(cfg)
    assert not worker.model.lm_head.weight.is_mkldnn  # (bf16-stored weights are never packed: no second copy)
    assert worker.weight_bytes() == cost.weight_bytes
    float32 = ModelCost(cfg.model.arch, "float32")
    a = cfg.model.arch
    q, kv, h, i = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.hidden_size, a.intermediate_size
    projections = a.num_layers * (h * (q + 2 * kv) + q * h + 2 * i * h + h * i)
    tables = 1 if a.tie_word_embeddings else 2  # the embedding (a tied lm_head's too), an untied lm_head
    assert float32.weight_bytes - cost.weight_bytes == 2 * (projections + tables * a.vocab_size * h)  # 2 bytes each
    # a step reads the projections and one vocabulary matrix (the lm_head's); ModelCost counts an untied model's
    # one embedding row a token at float32's bytes in both
    assert float32.decode_weight_bytes() - cost.decode_weight_bytes() == 2 * (projections + a.vocab_size * h)
    assert float32.matmul_weight_bytes - cost.matmul_weight_bytes == 2 * (projections + a.vocab_size * h)


@pytest.mark.parametrize("name", ["mixtral-8x-top2", "qwen2moe-shared"])
def test_model_cost_counts_the_bf16_experts(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: str,
                                            monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """A mixture of experts keeps every expert's (and a shared expert's) projections in bf16 too, its routers in
    float32: the bytes the loaded model holds are ModelCost's, and a decode step counts the experts it reads."""
    monkeypatch.setattr(config, "cpu_runs_bf16", lambda: False)
    d = build_model(name, str(tmp_path_factory.mktemp("bf16") / name), tokenizer_dir, dtype="bfloat16")
    cfg = EngineArgs(d, kv_cache_memory="8MiB").create_engine_config()
    assert cfg.model.linear_weight_dtype == "bfloat16"
    worker = Worker(cfg)
    routers = [m.weight for n, m in worker.model.named_modules() if n.endswith("mlp.gate")]
    assert routers and all(w.dtype == torch.float32 for w in routers)
    assert worker.weight_bytes() == model_cost(cfg).weight_bytes
    cost, float32 = model_cost(cfg), ModelCost(cfg.model.arch, "float32")
    a, moe = cfg.model.arch, cfg.model.arch.moe
    assert moe is not None
    q, kv, h = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.hidden_size
    attention = a.num_layers * (h * (q + 2 * kv) + q * h)
    dense = (a.num_layers - moe.num_sparse_layers) * 3 * h * a.intermediate_size  # (Qwen2-MoE's mlp_only_layers)
    expert, shared = 3 * h * moe.intermediate_size, 3 * h * moe.shared_intermediate_size
    vocab = a.vocab_size * h
    for batch in (1, 3):  # the experts a step reads: k for one token, the expected count for more
        read = moe.top_k if batch == 1 else moe.num_experts * (1 - (1 - moe.top_k / moe.num_experts) ** batch)
        bf16 = attention + dense + round(moe.num_sparse_layers * (read * expert + shared)) + vocab
        assert float32.decode_weight_bytes(batch) - cost.decode_weight_bytes(batch) == 2 * bf16


@pytest.mark.parametrize("rows_dtype", [torch.float32, torch.bfloat16])
def test_bf16_products_without_onednn_widen_the_weight(rows_dtype: torch.dtype) -> None:
    # bf16_products where oneDNN has no bf16 path (pack=False stands in for an AVX2 CPU or a GPU): the weight stays
    # unpacked and widens as a weight_dtype layer's does; bf16 rows (a BERT's attention output) widen first
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(37, 64, generator=gen).to(torch.bfloat16)
    b = torch.randn(37, generator=gen)
    method = UnquantizedLinearMethod(pack=False, weight_dtype=torch.bfloat16, bf16_products=True)
    layer = Linear(64, 37, True, torch.float32, method)
    layer.weight_loader(layer.weight, w)
    assert layer.bias is not None
    layer.weight_loader(layer.bias, b)
    method.process_weights_after_loading(layer)
    assert not layer.packed and layer.weight.dtype == torch.bfloat16
    x = torch.randn(9, 64, generator=gen).to(rows_dtype)
    got = layer(x)
    assert got.dtype == torch.float32
    close(got, F.linear(x.float(), w.float(), b))


def test_one_bf16_products_method_serves_one_dtype() -> None:
    method = UnquantizedLinearMethod(pack=False, weight_dtype=torch.bfloat16, bf16_products=True)
    Linear(8, 8, True, torch.float32, method)
    with pytest.raises(ValueError, match="one dtype"):
        Linear(8, 8, True, torch.float16, method)
