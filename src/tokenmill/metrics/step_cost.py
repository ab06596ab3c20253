"""The work of one engine step, counted with tokenmill.model_math's conventions, so that the serving
metrics and `tokenmill bench latency` / `throughput` give one answer for the same step.

A step computes `tokens` rows; request i's chunk ends at position e_i (its KV after the step) and
starts at e_i - n_i:
- bytes: the weights a step of that many tokens reads (ModelCost.decode_weight_bytes: matmul weights
  once, embedding rows per token, MoE experts as routed) plus every request's whole KV, e_i tokens;
  at batch B of decodes at context c that is ModelCost.decode_bytes(B, c).
- FLOPs: 2 x the body's weights per row, 2 x the lm_head per sampled row (a prefill chunk samples only
  when it reaches the prompt's end), and the attention of each row over the positions before it
  (sum of e_i - n_i + 1 .. e_i); a whole prompt's prefill is ModelCost.prefill_flops_per_token x P.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.messages import StepStats
from tokenmill.kv_cache_spec import kv_storage_dtype
from tokenmill.metrics.ceilings import Ceilings, utilization
from tokenmill.model_math import ModelCost, decode_floor, kv_capacity, max_requests


@dataclass(frozen=True)
class PlanFigures:
    """`tokenmill plan`'s arithmetic for the running engine (tokenmill.model_math): the decode floor of
    one sequence at `context` tokens (max_model_len / 2), and how many tokens / such requests the pool holds."""

    decode_floor_ms: float | None
    context: int
    capacity_tokens: int
    capacity_requests: int
    block_size: int


def model_cost(config: EngineConfig) -> ModelCost:
    """The running engine's model as tokenmill.model_math counts it (dtype, KV storage, weight format)."""
    quant = config.model.quantization
    return ModelCost(config.model.arch, config.model.dtype,
                     kv_storage_dtype(config.cache.kv_cache_dtype, config.model.dtype),
                     quantization=None if quant is None else quant.scheme,
                     linear_dtype=config.model.linear_weight_dtype, lm_head_int8=quant is not None and quant.lm_head)


def plan_figures(config: EngineConfig, ceilings: Ceilings | None) -> PlanFigures:
    """`tokenmill plan`'s figures for this engine: the batch-1 decode floor at max_model_len / 2 tokens of
    context (None without both ceilings), and the tokens and such requests its KV budget holds
    (--kv-cache-memory, or --num-kv-blocks where given), to set beside the pool the engine built."""
    cost, bs = model_cost(config), config.cache.block_size
    context = max(1, config.model.max_model_len // 2)
    floor = None
    if ceilings is not None and ceilings.bandwidth_gbps and ceilings.gflops:
        floor = decode_floor(cost, 1, context, ceilings.bandwidth_gbps, ceilings.gflops).floor_s * 1e3
    blocks = config.cache.num_kv_blocks
    capacity = blocks * bs if blocks is not None else kv_capacity(config.cache.kv_cache_bytes, cost, bs)
    return PlanFigures(floor, context, capacity, max_requests(capacity, context, bs), bs)


def attended_positions(end: int, n: int) -> int:
    """Positions the rows of a chunk of n tokens ending at `end` attend to, in all (causal)."""
    return n * end - n * (n - 1) // 2


def step_bytes(cost: ModelCost, tokens: int, kv_tokens: int) -> float:
    return float(cost.decode_weight_bytes(tokens) + kv_tokens * cost.kv_bytes_per_token)


def step_flops(cost: ModelCost, tokens: int, sampled_rows: int, attended: int) -> float:
    body = cost.matmul_params - cost.head_matmul_params
    return float(2 * body * tokens + 2 * cost.head_matmul_params * sampled_rows
                 + cost.attn_flops_per_position * attended)


def step_rates(first: StepStats, last: StepStats) -> tuple[float, float] | None:
    """GB/s and GFLOP/s of the steps between two snapshots of the counters, per second of step time
    (None if no step ran between them)."""
    busy = last.busy_s - first.busy_s
    if last.steps <= first.steps or busy <= 0:
        return None
    return (last.bytes - first.bytes) / busy / 1e9, (last.flops - first.flops) / busy / 1e9


def engine_fields(first: StepStats | None, last: StepStats | None, roof: Ceilings) -> dict[str, Any]:
    """The benches' record of what the engine's own step counters (and so /metrics) say about the same
    work: achieved rates over the steps' busy time and MBU/MFU against the same ceilings."""
    rates = None if first is None or last is None else step_rates(first, last)
    out: dict[str, Any] = {"engine_GBps": None, "engine_gflops": None, "engine_mbu": None, "engine_mfu": None}
    if rates is None:
        return out
    out["engine_GBps"], out["engine_gflops"] = round(rates[0], 4), round(rates[1], 4)
    if roof.bandwidth_gbps:
        out["engine_mbu"] = round(utilization(rates[0], roof.bandwidth_gbps).ratio, 4)
    if roof.gflops:
        out["engine_mfu"] = round(utilization(rates[1], roof.gflops).ratio, 4)
    return out
