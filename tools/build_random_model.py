"""Build a random-weight checkpoint of a given shape for benchmarking (no download): the tests'
fixture builder (tests/fixtures.py) at real sizes, saved in bfloat16 with the tests' tokenizer.

Usage (from the repository root)::

    .venv/bin/python tools/build_random_model.py mixtral-1b /tmp/mixtral-1b      # 1.01B total, 0.30B active
    .venv/bin/python tools/build_random_model.py deepseek-v2-1b /tmp/dsv2-1b     # MLA + MoE, 0.99B total
    .venv/bin/python tools/build_random_model.py llama-gqa-1b /tmp/llama-1b      # dense GQA, 0.98B
    .venv/bin/python tools/build_random_model.py llama-1.1b /tmp/llama-1.1b      # TinyLlama's shape, 1.1B

(sizes as `tokenmill plan` counts them). `--tokenizer DIR` copies a tokenizer (e.g. the anchors kit's
32000-token Llama one) in place of the tests' BPE, for llama.cpp's GGUF converter.

The shapes of the CPU sizes users run are written a decoder layer at a time, never held whole (an 8B model's float32
copy would not fit in this machine's memory)::

    .venv/bin/python tools/build_random_model.py llama-3b /tmp/llama-3b     # 2.8B, the anchors kit's 3B shape
    .venv/bin/python tools/build_random_model.py llama-8b /tmp/llama-8b     # 7.2B, Llama-3-8B's shape (vocab 32000)

Then e.g. ``tokenmill bench latency --model /tmp/mixtral-1b --dtype bfloat16 --input-len 128
--output-len 128`` (MBU counts the k routed experts a batch-1 step reads), ``tokenmill plan
/tmp/dsv2-1b`` (MLA's KV bytes per token and capacity gain).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.fixtures import MODEL_SPECS, build_model, train_tokenizer  # noqa: E402

COMMON: dict[str, Any] = dict(vocab_size=32000, max_position_embeddings=8192, initializer_range=0.02,
                              tie_word_embeddings=False)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    # Mixtral's shape scaled down: 8 experts, top 2, GQA 4:1, expert MLP ~3.5x hidden
    "mixtral-1b": ("mixtral", dict(COMMON, hidden_size=1024, intermediate_size=2304, num_hidden_layers=16,
                                   num_attention_heads=16, num_key_value_heads=4, num_local_experts=8,
                                   num_experts_per_tok=2, rope_theta=1e6)),
    # DeepSeek-V2-Lite's shape scaled down: MLA (kv_lora_rank 512 -> 256), 1 dense layer then MoE
    "deepseek-v2-1b": ("deepseek_v2", dict(COMMON, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
                                           num_attention_heads=16, q_lora_rank=None, kv_lora_rank=256,
                                           qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                                           n_routed_experts=32, num_experts_per_tok=6, n_shared_experts=2,
                                           moe_intermediate_size=512, first_k_dense_replace=1,
                                           topk_method="greedy", routed_scaling_factor=1.0, norm_topk_prob=False)),
    # TinyLlama-1.1B's shape (GQA 8:1, head_dim 64): the GPU path's targets (tools/gpu_check.sh)
    "llama-1.1b": ("llama", dict(COMMON, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                 num_attention_heads=32, num_key_value_heads=4)),
    # a dense GQA model of about the same total size (the MLA comparison's baseline)
    "llama-gqa-1b": ("llama", dict(COMMON, hidden_size=2048, intermediate_size=6912, num_hidden_layers=16,
                                   num_attention_heads=16, num_key_value_heads=4)),
}
# written a layer at a time (write_streamed): weights N(0, 0.02), norms N(1, 0.2), as build_model's
STREAMED: dict[str, dict[str, Any]] = {
    "llama-3b": dict(COMMON, hidden_size=3072, intermediate_size=8192, num_hidden_layers=26,
                     num_attention_heads=24, num_key_value_heads=8),
    "llama-8b": dict(COMMON, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0),
}


def write_streamed(fields: dict[str, Any], out_dir: str, tokenizer_dir: str, seed: int) -> None:
    """A random bf16 Llama of these config fields saved a shard at a time (one per decoder layer, one for the rest,
    with the index transformers writes), each shard's tensors generated just before it is saved: the shapes come
    from transformers' model built on the meta device (no storage)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    cfg = transformers.LlamaConfig(**fields)
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in transformers.LlamaForCausalLM(cfg).state_dict().items()}
    shards: dict[str, list[str]] = {}
    for name in shapes:
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        shards.setdefault("rest" if layer is None else f"layer-{int(layer):03d}", []).append(name)
    os.makedirs(out_dir, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    for shard, names in shards.items():
        tensors = {}
        for name in names:
            mean, std = (1.0, 0.2) if "norm" in name else (0.0, cfg.initializer_range)
            tensors[name] = torch.empty(shapes[name]).normal_(mean, std, generator=gen).to(torch.bfloat16)
        file = f"model-{shard}.safetensors"
        save_file(tensors, os.path.join(out_dir, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    total = sum(2 * math.prod(shape) for shape in shapes.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    cfg.architectures, cfg.dtype = ["LlamaForCausalLM"], "bfloat16"
    cfg.save_pretrained(out_dir)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), out_dir)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shape", choices=sorted([*SHAPES, *STREAMED]))
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=JSON",
                   help="override config fields, e.g. num_hidden_layers=2 hidden_size=256")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="copy this directory's tokenizer files (" + ", ".join(TOKENIZER_FILES) + ") instead of "
                        "training the tests' 512-token BPE; e.g. a 32000-token Llama tokenizer, which llama.cpp's "
                        "GGUF converter reads")
    args = p.parse_args()
    family, fields = SHAPES[args.shape] if args.shape in SHAPES else ("llama", STREAMED[args.shape])
    for item in args.set:
        key, _, value = item.partition("=")
        fields = {**fields, key: json.loads(value)}
    MODEL_SPECS[args.shape] = (family, fields)
    with tempfile.TemporaryDirectory() as tok_dir:
        if args.tokenizer:
            for name in TOKENIZER_FILES:
                if os.path.exists(os.path.join(args.tokenizer, name)):
                    shutil.copy(os.path.join(args.tokenizer, name), tok_dir)
        else:
            train_tokenizer(tok_dir)
        if args.shape in STREAMED:
            write_streamed(fields, args.out_dir, tok_dir, args.seed)
        else:
            build_model(args.shape, args.out_dir, tok_dir, seed=args.seed, max_shard_size="2GB", dtype="bfloat16")
    print(args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
