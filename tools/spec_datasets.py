"""Workloads for speculative decoding's benchmarks (`tokenmill bench latency --dataset FILE.jsonl`),
built from the held-out plays of the demo corpus (tools/demo_data.py: Coriolanus and Twelfth Night,
never trained on), one JSON object a line with a "prompt":

- `copy`: prompts that quote a passage and ask to repeat it or lightly edit it (every third one asks
  for it in upper case, every third for it with one word swapped), so the answer copies the prompt:
  prompt lookup's case. Rendered as chats with the demo chat template;
- `continuation`: the running text of a held-out play up to a point, to be continued (the draft
  model's and Medusa's case).

    python tools/spec_datasets.py copy --out tmp/spec/copy.jsonl --num 32
    python tools/spec_datasets.py continuation --out tmp/spec/shakespeare.jsonl --num 32

Passages are chosen with a seeded random generator, so a file is reproducible from its arguments.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_data  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ASKS = ("Repeat this passage word for word:", "Say this passage again in upper case:",
        "Repeat this passage, but say \"{new}\" wherever it says \"{old}\":")


def held_out_texts(cache_dir: Path) -> list[str]:
    """The running text of the held-out plays."""
    _, held_out = demo_data.split_works(demo_data.read_works(demo_data.fetch_archive(cache_dir)))
    return [w.text for w in held_out]


def passages(texts: Iterable[str], lines: int) -> list[str]:
    """Consecutive `lines`-line pieces of the texts' non-empty lines."""
    out = []
    for text in texts:
        kept = [ln for ln in text.split("\n") if ln.strip()]
        out.extend("\n".join(kept[i:i + lines]) for i in range(0, len(kept) - lines + 1, lines))
    return out


def copy_prompts(texts: list[str], num: int, seed: int, lines: int = 6) -> list[str]:
    rng = random.Random(seed)
    pool = passages(texts, lines)
    out = []
    for i in range(num):
        passage = rng.choice(pool)
        ask = ASKS[i % len(ASKS)]
        if "{old}" in ask:
            words = [w for w in passage.split() if w.isalpha() and len(w) > 3] or ["the"]
            ask = ask.format(old=rng.choice(words), new=rng.choice(["friend", "lord", "night", "sword"]))
        chat = [{"role": "user", "content": f"{ask}\n\n{passage}"}]
        out.append(demo_data.render_chat(chat, add_generation_prompt=True))
    return out


def continuation_prompts(texts: list[str], num: int, seed: int, chars: int = 1200) -> list[str]:
    """Running text ending at a line end, `chars` characters or so, from a random place."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        text = rng.choice(texts)
        end = text.find("\n", rng.randrange(chars, len(text) - chars))
        out.append(text[max(0, end - chars):end + 1])
    return out


def write_jsonl(prompts: list[str], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=("copy", "continuation"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--num", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", type=Path, default=REPO / "tmp" / "demo-data")
    args = p.parse_args(argv)
    texts = held_out_texts(args.cache_dir)
    make = copy_prompts if args.kind == "copy" else continuation_prompts
    write_jsonl(make(texts, args.num, args.seed), args.out)
    print(f"{args.num} {args.kind} prompts -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
