"""Held-out perplexity of a model as tokenmill runs it (its layers, its quantized kernels), measured as
the demo model's card measures it: the running text of the held-out plays (*Coriolanus* and *Twelfth
Night*, each followed by <|end|>) tokenized by the model's tokenizer, cut into non-overlapping 512-token
windows plus the shorter tail, every token but a window's first predicted; exp(mean NLL). Weights load
as float32 (a bf16 checkpoint is evaluated in float32, as on the card), or quantized with
--quantization (or as the checkpoint's quantization_config says).

    .venv/bin/python tools/perplexity.py --model models/tokenmill-demo [--quantization int8|int4|w8a8]
    .venv/bin/python tools/perplexity.py --write-calibration tmp/calibration.txt  # a training-text sample

The corpus archive is fetched and checked as tools/demo_data.py does (into --cache-dir).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_data  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WINDOW = 512


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=REPO / "models" / "tokenmill-demo")
    p.add_argument("--quantization", default=None, help="as `tokenmill serve --quantization`")
    p.add_argument("--cache-dir", type=Path, default=REPO / "tmp" / "demo-data")
    p.add_argument("--max-windows", type=int, default=None, help="only the first N windows (a quick look)")
    p.add_argument("--write-calibration", type=Path, default=None,
                   help="write a sample of the training text (running text of the training plays) here and exit")
    p.add_argument("--calibration-chars", type=int, default=60000)
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args()


def held_out_windows(model_dir: Path, cache_dir: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    _, held = demo_data.split_works(demo_data.read_works(demo_data.fetch_archive(cache_dir)))
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = [i for w in held for i in tok.encode(w.text + demo_data.END).ids]
    full = len(ids) // WINDOW * WINDOW
    windows = [ids[s:s + WINDOW] for s in range(0, full, WINDOW)]
    return windows + ([ids[full:]] if len(ids) - full >= 2 else [])


def load(model_dir: Path, quantization: str | None) -> torch.nn.Module:
    from tokenmill.arch import load_arch_config
    from tokenmill.kernels import load_cpu_kernels
    from tokenmill.layers.linear import LinearMethod, UnquantizedLinearMethod
    from tokenmill.layers.quantization import QuantizedLinearMethod
    from tokenmill.models.loader import load_model
    from tokenmill.quantization_config import resolve_quantization

    quant = resolve_quantization(str(model_dir), quantization)
    method: LinearMethod = (UnquantizedLinearMethod() if quant is None
                            else QuantizedLinearMethod(quant, load_cpu_kernels()))
    return load_model(str(model_dir), load_arch_config(str(model_dir)), torch.float32, torch.device("cpu"), method)


@torch.inference_mode()
def window_nll(model: torch.nn.Module, ids: list[int]) -> float:
    """Summed NLL of tokens 1..n-1 of one window, the window prefilled from an empty KV cache."""
    from tokenmill.attention import get_backend
    from tokenmill.attention.backend import AttentionMetadata
    from tokenmill.kv_cache_spec import plan_kv_cache
    from tokenmill.worker.kv_cache import allocate_kv_caches, bind_kv_caches, kv_cache_specs

    n, block = len(ids), 32
    cfg = plan_kv_cache(kv_cache_specs(model, block, "float32"), 64 << 20)
    bind_kv_caches(model, allocate_kv_caches(cfg, torch.device("cpu")), get_backend("sdpa"))
    meta = AttentionMetadata(slot_mapping=torch.arange(n), query_start_loc=[0, n], seq_lens=[n],
                             block_tables=[list(range(-(-n // block)))], num_decodes=0, block_size=block)
    x = torch.tensor(ids)
    logits = model.compute_logits(model(x, torch.arange(n), meta))  # type: ignore[operator]
    return float(torch.nn.functional.cross_entropy(logits[:-1].float(), x[1:], reduction="sum"))


def write_calibration(path: Path, cache_dir: Path, chars: int) -> None:
    train, _ = demo_data.split_works(demo_data.read_works(demo_data.fetch_archive(cache_dir)))
    text = "".join(w.text + demo_data.END + "\n" for w in train)[:chars]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(f"wrote {len(text)} characters of training text to {path}")


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.write_calibration is not None:
        write_calibration(args.write_calibration, args.cache_dir, args.calibration_chars)
        return
    windows = held_out_windows(args.model, args.cache_dir)[:args.max_windows]
    model = load(args.model, args.quantization)
    nll = sum(window_nll(model, w) for w in windows)
    count = sum(len(w) - 1 for w in windows)
    print(json.dumps({"model": str(args.model), "quantization": args.quantization, "windows": len(windows),
                      "predicted_tokens": count, "perplexity": round(math.exp(nll / count), 3)}))


if __name__ == "__main__":
    main()
