"""`tokenmill plan MODEL`: the serving arithmetic of a checkpoint from its config.json: parameters and
weight bytes, KV bytes per token, how many tokens and requests fit in a memory budget (for the chosen
`--kv-cache-dtype`, and under `kv_cache_dtypes` for each one), and the decode floor per step by batch
size (bytes / bandwidth vs FLOPs / the peak FLOP rate, whichever is larger)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tokenmill.arch import ArchConfig, load_arch_config
from tokenmill.bench.model_math import (
    INT4_GROUP,
    QUANTIZED_FORMATS,
    ModelCost,
    decode_floor,
    dtype_bytes,
    kv_capacity,
    max_requests,
)
from tokenmill.bench.roofline import Ceilings, ceilings
from tokenmill.config import bf16_weights_kept, default_block_size, parse_memory
from tokenmill.cpu_features import cpu_runs_bf16
from tokenmill.kv_cache_spec import KV_CACHE_DTYPE_CHOICES, kv_storage_dtype
from tokenmill.quantization_config import RTN_LM_HEAD_METHODS

DEFAULT_BATCHES = "1,2,4,8,16,32,64,128,256"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("plan", help="memory, KV capacity and decode/prefill floors of a checkpoint")
    p.add_argument("model", help="a Hugging Face checkpoint directory (only config.json is read)")
    p.add_argument("--memory", default="4GiB", help="memory for weights + KV cache, e.g. 4GiB")
    p.add_argument("--kv-cache-memory", default=None, help="KV cache budget alone (overrides --memory)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="weights and KV dtype (default: as the engine's dtype auto runs the checkpoint on this CPU)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                   help="KV cache storage, as the engine's flag (default: auto, the weights' dtype)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length a request may reach")
    p.add_argument("--context", type=int, default=None,
                   help="average context per sequence in the decode table (default: max-model-len / 2)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt length for prefill FLOPs (default 512)")
    p.add_argument("--block-size", type=int, default=default_block_size("cpu"),
                   help="KV tokens per block (default: the engine's on CPU)")
    p.add_argument("--batch-sizes", default=DEFAULT_BATCHES)
    p.add_argument("--bandwidth", type=float, default=None, help="memory bandwidth, GB/s")
    p.add_argument("--flops", type=float, default=None,
                   help="peak FLOP rate of the dtype, GFLOP/s (default: the roofline cache's)")
    p.add_argument("--threads", type=int, default=None, help="which cached roofline measurement to use")
    p.add_argument("--measure", action="store_true", help="measure the roofline if it is not cached")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=run)


def resolve_dtype(arch: ArchConfig, dtype: str | None) -> str:
    return resolve_dtypes(arch, dtype)[0]


def resolve_dtypes(arch: ArchConfig, dtype: str | None) -> tuple[str, str | None]:
    """(model dtype, stored linear-weight dtype or None) as the engine runs the checkpoint on this CPU: a given
    --dtype as is; else the checkpoint's (bfloat16 if it names none), float16 as bfloat16, and bfloat16 on a
    CPU without bf16 products in float32 over bf16-stored weights where the engine keeps them
    (config.bf16_weights_kept), as its dtype auto does."""
    if dtype is not None:
        return dtype, None
    resolved = arch.dtype if arch.dtype in ("bfloat16", "float16", "float32") else "bfloat16"
    if resolved == "float16":
        resolved = "bfloat16"
    if resolved == "bfloat16" and not cpu_runs_bf16():
        return "float32", "bfloat16" if bf16_weights_kept(arch) else None
    return resolved, None


def _size(value: str, flag: str) -> int:
    try:
        size = parse_memory(value)
    except ValueError:
        size = -1
    if isinstance(size, float) or size <= 0:
        raise ValueError(f"{flag} {value!r} is not a size like '4GiB' or '512MB'")
    return size


def _positive(value: int | None, flag: str) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{flag} must be >= 1, got {value}")


def build_plan(args: argparse.Namespace, roof: Ceilings) -> dict[str, Any]:
    arch = load_arch_config(args.model)
    dtype, linear_dtype = resolve_dtypes(arch, args.dtype)
    kv_choice = getattr(args, "kv_cache_dtype", "auto")
    cost = ModelCost(arch, dtype, kv_storage_dtype(kv_choice, dtype), linear_dtype=linear_dtype)
    for flag in ("max_model_len", "context", "prompt_len", "block_size"):
        _positive(getattr(args, flag), "--" + flag.replace("_", "-"))
    max_len = args.max_model_len or arch.max_position_embeddings
    context = args.context or max(1, max_len // 2)
    prompt_len = args.prompt_len or min(512, max_len)
    if args.kv_cache_memory is not None:
        memory, kv_budget = None, _size(args.kv_cache_memory, "--kv-cache-memory")
    else:
        memory = _size(args.memory, "--memory")
        kv_budget = max(0, memory - cost.weight_bytes)
    capacity = kv_capacity(kv_budget, cost, args.block_size)
    try:
        batches = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        raise ValueError(f"--batch-sizes {args.batch_sizes!r} is not a comma-separated list of integers") from None
    plan: dict[str, Any] = {
        "model": args.model, "architecture": arch.architecture, "dtype": dtype, "dtype_bytes": dtype_bytes(dtype),
        "linear_weight_dtype": linear_dtype,
        "params": cost.params, "embedding_params": cost.embedding_params, "lm_head_params": cost.lm_head_params,
        "tie_word_embeddings": arch.tie_word_embeddings, "matmul_params": cost.matmul_params,
        "weight_bytes": cost.weight_bytes, "decode_weight_bytes": cost.decode_weight_bytes(1),
        "kv_cache_dtype": kv_choice, "kv_bytes_per_token": cost.kv_bytes_per_token,
        "kv_cache_dtypes": kv_dtype_table(arch, dtype, kv_budget, args.block_size, max_len, context),
        # each format as --quantization makes it (int8 and int4 round the lm_head to int8 too)
        "weight_bytes_by_format": {f: ModelCost(arch, dtype, quantization=None if f == dtype else f,
                                                linear_dtype=linear_dtype if f == dtype else None,
                                                lm_head_int8=f in RTN_LM_HEAD_METHODS).weight_bytes
                                   for f in (dtype, *QUANTIZED_FORMATS)},
        "layers": arch.num_layers, "heads": arch.num_heads,
        "kv_heads": arch.num_kv_heads, "head_dim": arch.head_dim, "max_model_len": max_len,
        "memory_bytes": memory, "kv_cache_bytes": kv_budget, "block_size": args.block_size,
        "max_kv_tokens": capacity, "max_requests_at_max_model_len": max_requests(capacity, max_len, args.block_size),
        "context": context, "max_requests_at_context": max_requests(capacity, context, args.block_size),
        "prompt_len": prompt_len, "prefill_flops_per_token": round(cost.prefill_flops_per_token(prompt_len)),
        "attn_flops_per_position": cost.attn_flops_per_position,
        "kv_layout": "mla" if arch.mla is not None else "kv",
        "full_kv_bytes_per_token": cost.full_kv_bytes_per_token,
        "kv_capacity_gain": cost.full_kv_bytes_per_token / cost.kv_bytes_per_token,
        "active_params": cost.active_params,
        "mem_read_GBps": roof.bandwidth_gbps, "peak_gflops": roof.gflops,
        "bandwidth_source": roof.bandwidth_source, "flops_source": roof.flops_source,
    }
    rows: list[dict[str, Any]] = []
    for b in batches:
        _positive(b, "--batch-sizes")
        row: dict[str, Any] = {"batch": b, "bytes": cost.decode_bytes(b, context),
                               "flops": cost.decode_flops(b, context), "fits": b * context <= capacity}
        if roof.bandwidth_gbps and roof.gflops:
            f = decode_floor(cost, b, context, roof.bandwidth_gbps, roof.gflops)
            row.update({"memory_ms": f.memory_s * 1e3, "compute_ms": f.compute_s * 1e3, "floor_ms": f.floor_s * 1e3,
                        "tok_s": f.tok_s, "bound": f.bound})
        rows.append(row)
    plan["decode"] = rows
    if arch.mla is not None:
        plan.update(kv_lora_rank=arch.mla.kv_lora_rank, qk_rope_head_dim=arch.mla.qk_rope_head_dim)
    if arch.moe is not None:
        plan.update(experts=arch.moe.num_experts, experts_per_token=arch.moe.top_k,
                    sparse_layers=arch.moe.num_sparse_layers)
    if roof.bandwidth_gbps and roof.gflops:
        crossover = cost.crossover_batch(context, roof.bandwidth_gbps, roof.gflops)
        plan["compute_bound_batch"] = None if crossover is None else round(crossover, 1)
        plan["prefill_tok_s_ceiling"] = roof.gflops * 1e9 / cost.prefill_flops_per_token(prompt_len)
    return plan


def kv_dtype_table(arch: ArchConfig, dtype: str, kv_budget: int, block_size: int, max_len: int,
                   context: int) -> list[dict[str, Any]]:
    """For each --kv-cache-dtype the model's caches take (MLA's latent cache: auto only, as the engine
    refuses a quantized one): bytes per token and the blocks, tokens and requests the budget holds."""
    rows = []
    for choice in ("auto",) if arch.mla is not None else ("auto", "int8", "fp8_e4m3"):
        cost = ModelCost(arch, dtype, kv_storage_dtype(choice, dtype))
        capacity = kv_capacity(kv_budget, cost, block_size)
        rows.append({"kv_cache_dtype": choice, "storage": cost.kv_dtype, "kv_bytes_per_token": cost.kv_bytes_per_token,
                     "kv_blocks": capacity // block_size, "max_kv_tokens": capacity,
                     "max_requests_at_max_model_len": max_requests(capacity, max_len, block_size),
                     "max_requests_at_context": max_requests(capacity, context, block_size)})
    return rows


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def render(plan: dict[str, Any]) -> str:
    p = plan
    tied = "tied: counted once" if p["tie_word_embeddings"] else f"lm_head {_count(p['lm_head_params'])}, untied"
    if p["kv_layout"] == "mla":
        kv = (f"KV cache     {p['kv_bytes_per_token']} B/token  (MLA: {p['layers']} layers x ({p['kv_lora_rank']} "
              f"latent + {p['qk_rope_head_dim']} rope key) x {p['dtype_bytes']} B; full K/V would be "
              f"{p['full_kv_bytes_per_token']} B/token: {p['kv_capacity_gain']:.1f}x the tokens in the same memory)")
    else:
        kv = (f"KV cache     {p['kv_bytes_per_token']} B/token with --kv-cache-dtype {p['kv_cache_dtype']}  (K and V "
              f"of {p['layers']} layers x {p['kv_heads']} kv heads x {p['head_dim']})")
    experts = ""
    if "experts" in p:
        experts = (f"; {p['experts']} experts, {p['experts_per_token']} per token in {p['sparse_layers']} layers: "
                   f"{_count(p['active_params'])} active")
    lines = [
        f"model        {p['model']}  ({p['architecture']}, {p['dtype']}"
        f"{', linear weights stored ' + p['linear_weight_dtype'] if p['linear_weight_dtype'] else ''})",
        f"parameters   {_count(p['params'])}  (embedding {_count(p['embedding_params'])}, {tied}){experts}; "
        f"weights {p['weight_bytes'] / 1e6:.1f} MB",
        "weights by   " + ", ".join(f"{f} {b / 1e6:.1f} MB" for f, b in p["weight_bytes_by_format"].items())
        + f" (int4: groups of {INT4_GROUP})",
        f"per decode   {p['decode_weight_bytes'] / 1e6:.1f} MB of weights read per step "
        "(embedding table: used rows only" + ("; routed experts: the k chosen)" if experts else ")"),
        kv,
        f"memory       {_gib(p['memory_bytes'])} total -> KV {_gib(p['kv_cache_bytes'])}: "
        f"{p['max_kv_tokens']:,} tokens; "
        f"{p['max_requests_at_max_model_len']} requests at {p['max_model_len']} tokens, "
        f"{p['max_requests_at_context']} at {p['context']}",
        f"prefill      {p['prefill_flops_per_token'] / 1e9:.3f} GFLOP/token at a {p['prompt_len']}-token prompt "
        f"(2 x {_count(p['matmul_params'])} matmul params + {p['attn_flops_per_position']} x position)",
    ]
    if p["mem_read_GBps"] and p["peak_gflops"]:
        lines.append(f"roofline     {p['mem_read_GBps']:.1f} GB/s ({p['bandwidth_source']}), "
                     f"{p['peak_gflops']:.1f} GFLOP/s ({p['flops_source']})")
        cb = p["compute_bound_batch"]
        lines.append(f"             prefill ceiling {p['prefill_tok_s_ceiling']:,.0f} tok/s; "
                     "decode turns compute-bound "
                     + ("never (KV traffic grows as fast)" if cb is None else f"at batch ~{cb}"))
    else:
        lines.append("roofline     unknown: pass --bandwidth and --flops, or --measure "
                     "(or run `tokenmill bench roofline`)")
    lines.append(f"\nKV cache dtype   B/token   blocks  requests at {p['max_model_len']} / at {p['context']} tokens")
    for r in p["kv_cache_dtypes"]:
        lines.append(f"{r['kv_cache_dtype']:<9} {r['storage']:<14} {r['kv_bytes_per_token']:>8} {r['kv_blocks']:>8}  "
                     f"{r['max_requests_at_max_model_len']} / {r['max_requests_at_context']}")
    lines.append(f"\ndecode floor per step, average context {p['context']} tokens:")
    head = f"{'batch':>6} {'MB/step':>9} {'GFLOP':>8} {'mem ms':>8} {'comp ms':>8} {'floor ms':>9} {'tok/s':>9}  bound"
    lines.append(head)
    for r in p["decode"]:
        cells = f"{r['batch']:>6} {r['bytes'] / 1e6:>9.1f} {r['flops'] / 1e9:>8.2f}"
        if "floor_ms" in r:
            cells += (f" {r['memory_ms']:>8.2f} {r['compute_ms']:>8.2f} {r['floor_ms']:>9.2f} {r['tok_s']:>9.0f}"
                      f"  {r['bound']}")
        lines.append(cells + ("" if r["fits"] else "  (KV does not fit)"))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    dtype = resolve_dtype(load_arch_config(args.model), args.dtype)
    roof = ceilings(dtype, args.bandwidth, args.flops, args.threads, measure_missing=args.measure)
    plan = build_plan(args, roof)
    sys.stdout.write((json.dumps(plan) if args.json else render(plan)) + "\n")
    return 0
