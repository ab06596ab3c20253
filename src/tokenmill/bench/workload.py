"""Benchmark workloads: random token-id prompts (the same recipe as the anchors kit's
make_workload.py, so the same arguments give the same requests) or a JSONL file of
`{"prompt" | "prompt_token_ids", "max_tokens"}` lines."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass


@dataclass
class BenchRequest:
    prompt_token_ids: list[int] | None
    prompt: str | None
    max_tokens: int


def parse_range(spec: str) -> tuple[int, int]:
    lo, _, hi = spec.partition(":")
    a, b = int(lo), int(hi or lo)
    if a < 1 or b < a:
        raise ValueError(f"bad length range {spec!r}: expected A or A:B with 1 <= A <= B")
    return a, b


def random_workload(num: int, input_len: str, output_len: str, vocab_low: int, vocab_high: int,
                    seed: int, shared_prefix_len: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    (ilo, ihi), (olo, ohi) = parse_range(input_len), parse_range(output_len)
    if shared_prefix_len > ilo:
        raise ValueError("shared prefix length must not exceed the shortest input length")
    prefix = [rng.randrange(vocab_low, vocab_high) for _ in range(shared_prefix_len)]
    out = []
    for _ in range(num):
        n_in = rng.randint(ilo, ihi)
        n_out = rng.randint(olo, ohi)
        ids = prefix + [rng.randrange(vocab_low, vocab_high) for _ in range(n_in - shared_prefix_len)]
        out.append(BenchRequest(ids, None, n_out))
    return out


def load_jsonl(path: str) -> list[BenchRequest]:
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                out.append(BenchRequest(row.get("prompt_token_ids"), row.get("prompt"), int(row["max_tokens"])))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a workload line ({e})") from None
            if out[-1].prompt_token_ids is None and out[-1].prompt is None:
                raise ValueError(f"{path}:{lineno}: needs 'prompt' or 'prompt_token_ids'")
    if not out:
        raise ValueError(f"{path} holds no requests")
    return out
