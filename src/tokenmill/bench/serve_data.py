"""Requests and arrival times for `tokenmill bench serve`.

A workload is a list of chains: each chain is one conversation whose turns are sent one after the
other (the next turn only once the previous one has finished), and chains start at the arrival
times. Every dataset but shared-prefix with --turns > 1 has one request per chain.

- random: prompts of uniform random token ids (sent as `prompt: [ids]`), or text made from such ids
  with a tokenizer (decoded, re-encoded and cut to length) - chat endpoints need text.
- jsonl: `{"prompt" | "prompt_token_ids", "max_tokens"}` lines (the anchors kit's workload format).
- shared-prefix: K random prefixes of P tokens; request i starts with prefix i mod K, then random
  tokens up to --input-len. With --turns T, turn t+1 repeats turn t's prompt, then a stand-in for
  the reply (max_tokens random tokens) and a new user part, so a prefix cache can reuse every
  earlier turn's prompt.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from typing import Any

from tokenmill.bench.workload import load_jsonl, parse_range


@dataclass
class ServeRequest:
    prompt: str | list[int]
    prompt_len: int | None  # tokens, when known on the client side
    max_tokens: int


Chain = list[ServeRequest]


class PromptMaker:
    """Turns token ids into what is sent: the ids themselves, or text when a tokenizer is given."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer

    def make(self, ids: list[int]) -> tuple[str | list[int], int]:
        if self.tokenizer is None:
            return list(ids), len(ids)
        text = self.tokenizer.decode(ids)
        ids = self.tokenizer.encode(text, add_special_tokens=False)[: len(ids)]
        return self.tokenizer.decode(ids), len(ids)


def load_tokenizer(path: str | None) -> Any | None:
    if path is None:
        return None
    from tokenmill.engine.input_processor import load_tokenizer as load_engine_tokenizer

    return load_engine_tokenizer(path)


def default_vocab_high(tokenizer: Any | None, model: str | None) -> int:
    if tokenizer is not None:
        return len(tokenizer)
    if model and os.path.isfile(os.path.join(model, "config.json")):
        from tokenmill.arch import load_arch_config

        return load_arch_config(model).vocab_size
    raise ValueError("random token ids need a vocabulary size: pass --vocab-high, --tokenizer DIR, "
                     "or a --model that is a local checkpoint directory")


def random_chains(num: int, input_len: str, output_len: str, vocab: tuple[int, int], seed: int,
                  maker: PromptMaker) -> list[Chain]:
    rng = random.Random(seed)
    (ilo, ihi), (olo, ohi) = parse_range(input_len), parse_range(output_len)
    chains = []
    for _ in range(num):
        n_in, n_out = rng.randint(ilo, ihi), rng.randint(olo, ohi)
        prompt, n = maker.make([rng.randrange(*vocab) for _ in range(n_in)])
        chains.append([ServeRequest(prompt, n, n_out)])
    return chains


def shared_prefix_chains(num: int, input_len: str, output_len: str, vocab: tuple[int, int], seed: int,
                         maker: PromptMaker, prefix_len: int, num_prefixes: int, turns: int,
                         prefix_order: str = "cycle") -> list[Chain]:
    """Conversations of `turns` requests, each starting with one of `num_prefixes` shared prefixes: in turn
    (conversation c takes prefix c mod num_prefixes) or, with prefix_order "random", drawn uniformly (so
    that no fixed rotation of servers lines up with the prefixes)."""
    if prefix_order not in ("cycle", "random"):
        raise ValueError(f"--prefix-order must be cycle or random, got {prefix_order!r}")
    rng = random.Random(seed)
    pick = random.Random(seed + 2)
    (ilo, ihi), (olo, ohi) = parse_range(input_len), parse_range(output_len)
    if prefix_len < 0 or prefix_len > ilo:
        raise ValueError(f"--prefix-len {prefix_len} must be between 0 and the shortest --input-len ({ilo})")
    if num_prefixes < 1 or turns < 1:
        raise ValueError("--num-prefixes and --turns must be >= 1")
    prefixes = [[rng.randrange(*vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    chains: list[Chain] = []
    for c in range(math.ceil(num / turns)):
        ids = list(prefixes[c % num_prefixes if prefix_order == "cycle" else pick.randrange(num_prefixes)])
        chain: Chain = []
        for _ in range(min(turns, num - c * turns)):
            if chain:  # a stand-in for the previous reply, then the next user part
                ids += [rng.randrange(*vocab) for _ in range(chain[-1].max_tokens)]
            ids += [rng.randrange(*vocab) for _ in range(rng.randint(ilo, ihi) - prefix_len)]
            prompt, n = maker.make(ids)
            chain.append(ServeRequest(prompt, n, rng.randint(olo, ohi)))
        chains.append(chain)
    return chains


def jsonl_chains(path: str, num: int | None, maker: PromptMaker) -> list[Chain]:
    chains = []
    for r in load_jsonl(path)[:num]:
        if r.prompt_token_ids is not None:
            prompt, n = maker.make(r.prompt_token_ids)
            chains.append([ServeRequest(prompt, n, r.max_tokens)])
        else:
            chains.append([ServeRequest(r.prompt or "", None, r.max_tokens)])
    return chains


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Start times (s from the beginning) of n chains: all at 0 for an infinite rate, else gaps drawn
    from a gamma distribution with mean 1/rate (shape = burstiness: 1 is Poisson, inf is constant)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed + 1)
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += 1 / rate if math.isinf(burstiness) else rng.gammavariate(burstiness, 1 / (rate * burstiness))
    return offsets
