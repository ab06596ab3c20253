"""Train Medusa heads (``tokenmill.spec_decode.medusa``) for a frozen target model on CPU.

Usage (from the repository root; the first line is how ``models/tokenmill-demo-medusa`` was made)::

    .venv/bin/python tools/train_medusa.py --target models/tokenmill-demo --out models/tokenmill-demo-medusa \\
        --steps 300 --seed 1234
    .venv/bin/python tools/train_medusa.py --target DIR --out DIR --steps 5 --text train.txt --eval-text held.txt

Data: by default the demo training text of ``train_demo_models.py`` (``demo_data.training_documents``
with its seed, the same shuffled running-text and dialogue documents, tokenised with the target's own
tokenizer and cut into non-overlapping windows), evaluated on the held-out plays (Coriolanus, Twelfth
Night). ``--text``/``--eval-text`` train and evaluate on plain text files instead.

Training: the target runs frozen (bfloat16 autocast); its final-normed hidden state at position t
feeds every head, and head i learns the target's own next-token distribution at position t + i + 1
(self-distillation: cross-entropy against the target's teacher-forced softmax there), so the heads
learn what the target would say rather than what the text says. Heads start as the target's own next
token head (zero residual weights) and share its lm_head, frozen. AdamW, warm-up then cosine decay,
fp32 master weights, one CPU thread, seeded: two runs give the same checkpoint.

Evaluation (what speculative decoding sees, greedy): at evenly spaced held-out positions t with a
fixed context before them, the target's greedy continuation g_0, g_1, ... from x_{<=t} (g_0 is the
newest token, the argmax at t); head i is accepted at t when its argmax from h_t equals g_{i+1}. The
chain with k heads takes 1 + (number of leading heads accepted) tokens per target step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # tokenizers: one thread, deterministic
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_data  # noqa: E402
import train_demo_models as demo  # noqa: E402

from tokenmill.spec_decode.medusa import MedusaConfig, MedusaHeads, load_medusa_heads  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, required=True, help="the target model's HF checkpoint directory")
    p.add_argument("--out", type=Path, required=True, help="where the heads' checkpoint goes")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=1, help="residual blocks per head")
    p.add_argument("--batch", type=int, default=2, help="windows per step")
    p.add_argument("--seq-len", type=int, default=demo.SEQ_LEN)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--text", type=Path, help="train on this text file instead of the demo training text")
    p.add_argument("--eval-text", type=Path, help="evaluate on this text file instead of the held-out plays")
    p.add_argument("--eval-positions", type=int, default=1024)
    p.add_argument("--eval-context", type=int, default=128, help="tokens of context before each position")
    p.add_argument("--cache-dir", type=Path, default=REPO / "tmp" / "demo-data")
    p.add_argument("--no-card", action="store_true", help="write no README.md")
    args = p.parse_args(argv)
    if args.steps < 1 or args.heads < 1 or args.layers < 1 or args.batch < 1 or args.seq_len < args.heads + 2:
        p.error("--steps, --heads, --layers and --batch must be positive and --seq-len above --heads + 1")
    return args


def token_streams(args: argparse.Namespace) -> tuple[list[int], list[int], dict[str, Any]]:
    """Training and evaluation token streams, with a description of the data for the card."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    info: dict[str, Any] = {}
    if args.text is None or args.eval_text is None:
        works = demo_data.read_works(demo_data.fetch_archive(args.cache_dir))
        train_works, held_out = demo_data.split_works(works)
    if args.text is not None:
        docs = [args.text.read_text()]
        info["train_data"] = args.text.name
    else:
        docs, info["doc_stats"] = demo_data.training_documents(train_works, demo.TARGET.seed)
        info["train_data"] = "demo"
    train = [i for enc in tok.encode_batch(docs) for i in enc.ids]
    if args.eval_text is not None:
        held = tok.encode(args.eval_text.read_text()).ids
        info["eval_data"] = args.eval_text.name
    else:
        held = [i for w in held_out for i in tok.encode(w.text + demo_data.END).ids]
        info["eval_data"] = "held-out plays: " + ", ".join(w.title for w in held_out)
    info["train_stream_tokens"], info["eval_stream_tokens"] = len(train), len(held)
    return train, held, info


def load_target(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval().requires_grad_(False)


def new_heads(target: Any, num_heads: int, layers: int) -> MedusaHeads:
    cfg = target.config
    heads = MedusaHeads(MedusaConfig(cfg.hidden_size, cfg.vocab_size, num_heads, layers))
    with torch.no_grad():
        heads.lm_head.weight.copy_(target.get_output_embeddings().weight)
    return heads


def distill_loss(heads: MedusaHeads, hidden: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Per head: cross-entropy of head i's prediction from h_t against the target's softmax at t + i + 1."""
    seq = hidden.shape[1]
    losses = []
    for i, head in enumerate(heads.heads):
        n = seq - i - 1
        logits = heads.lm_head(head(hidden[:, :n])).float()
        soft = target_logits[:, i + 1:].float().softmax(-1)
        losses.append(-(soft * logits.log_softmax(-1)).sum(-1).mean())
    return torch.stack(losses)


def train(args: argparse.Namespace, target: Any, data: torch.Tensor) -> tuple[MedusaHeads, dict[str, Any]]:
    torch.manual_seed(args.seed)
    heads = new_heads(target, args.heads, args.layers).train()
    params = [p for p in heads.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": demo.WEIGHT_DECAY},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    print(f"[medusa] {sum(p.numel() for p in params) / 1e6:.2f}M trained parameters, {args.steps} steps", flush=True)
    start, loss_sum = time.time(), torch.zeros(args.heads)
    for step, x in enumerate(demo.batches(data, args.batch, args.steps, args.seed)):
        for group in opt.param_groups:
            group["lr"] = demo.lr_at(step, args.steps, args.lr)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                out = target.model(input_ids=x)
                hidden = out.last_hidden_state
                target_logits = target.lm_head(hidden)
            losses = distill_loss(heads, hidden.detach(), target_logits)
        losses.sum().backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_sum += losses.detach()
        if (step + 1) % 20 == 0 or step + 1 == args.steps:
            elapsed = time.time() - start
            per_head = " ".join(f"{v:.3f}" for v in (loss_sum / (step % 20 + 1)).tolist())
            print(f"[medusa] step {step + 1}/{args.steps} loss per head {per_head} "
                  f"{(step + 1) * x.numel() / elapsed:.0f} tok/s {elapsed / 60:.1f} min", flush=True)
            loss_sum.zero_()
    stats = {"train_seconds": time.time() - start, "train_tokens": args.steps * args.batch * data.shape[1],
             "trained_parameters": sum(p.numel() for p in params), "hidden_size": heads.config.hidden_size,
             "final_losses": losses.tolist()}
    return heads.eval(), stats


@torch.no_grad()
def evaluate(target: Any, heads: MedusaHeads, held: list[int], positions: int, context: int,
             batch: int = 64) -> dict[str, Any]:
    """Greedy acceptance of each head against the target's own continuation, and of the chains."""
    k = heads.config.num_heads
    last = len(held) - 1
    if last < context:
        raise ValueError(f"evaluation text has {len(held)} tokens, fewer than --eval-context {context} + 1")
    ends = torch.linspace(context - 1, last, min(positions, last - context + 2)).round().long().unique().tolist()
    stream = torch.tensor(held)
    hits = torch.zeros(k)
    chain = torch.zeros(k)  # chain[j]: positions where heads 0..j are all accepted
    for lo in range(0, len(ends), batch):
        x = torch.stack([stream[e - context + 1:e + 1] for e in ends[lo:lo + batch]])
        out = target.model(input_ids=x, use_cache=True)
        h = out.last_hidden_state[:, -1]
        greedy = [target.lm_head(h).argmax(-1)]
        cache = out.cache
        for _ in range(k):
            step = target(input_ids=greedy[-1][:, None], cache=cache, use_cache=True)
            cache = step.cache
            greedy.append(step.logits[:, -1].argmax(-1))
        ok = heads(h).argmax(-1) == torch.stack(greedy[1:])  # [k, batch]
        hits += ok.sum(1)
        chain += ok.int().cumprod(0).sum(1)
    n = len(ends)
    return {"positions": n, "context": context, "head_acceptance": (hits / n).tolist(),
            "mean_accepted_length": [1.0 + float(chain[:j + 1].sum()) / n for j in range(k)]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    random.seed(args.seed)
    t0 = time.time()
    train_ids, held, info = token_streams(args)
    data = demo.windows(train_ids, args.seq_len)
    if len(data) < args.batch:
        raise SystemExit(f"training text gives {len(data)} windows of {args.seq_len} tokens, fewer than --batch")
    target = load_target(args.target)
    print(f"data: {len(train_ids)} training tokens, {len(held)} evaluation tokens, {time.time() - t0:.0f}s", flush=True)
    heads, stats = train(args, target, data)
    heads.save(args.out)
    t1 = time.time()
    metrics = evaluate(target, load_medusa_heads(args.out), held, args.eval_positions, args.eval_context)
    metrics["eval_seconds"] = time.time() - t1
    summary = {"args": {k: str(v) for k, v in vars(args).items()}, "data": info, "stats": stats,
               "metrics": metrics, "machine": machine()}
    print(json.dumps(summary, indent=2), flush=True)
    if not args.no_card:
        write_card(args.out, summary)
    return summary


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
        cpu = f"{names[0]}, {len(names)} logical CPUs" if names else cpu
    except OSError:
        pass
    return cpu


def write_card(out: Path, summary: dict[str, Any]) -> None:
    """The checkpoint's README.md: architecture, data, recipe and command, acceptance per head."""
    args, stats, m = summary["args"], summary["stats"], summary["metrics"]
    heads = len(m["head_acceptance"])
    rows = "\n".join(f"| {i} | +{i + 1} | {a:.1%} | {n:.3f} |" for i, (a, n) in
                     enumerate(zip(m["head_acceptance"], m["mean_accepted_length"], strict=True)))
    data, name, base = summary["data"], Path(args["out"]).name, Path(args["target"]).name
    if data["train_data"] == "demo":
        docs = data["doc_stats"]
        data_text = (f"The training text of `tokenmill-demo` (`tools/demo_data.py`): the {docs['running_text_docs']} "
                     f"training plays and poems as running text plus {docs['chat_docs']:,} chats cut from their "
                     f"dialogue, shuffled with the demo's seed, {data['train_stream_tokens']:,} tokens with the "
                     "target's tokenizer. *Coriolanus* and *Twelfth Night* are held out (the target never saw "
                     "them either); acceptance is measured on them.")
    else:
        data_text = (f"`{data['train_data']}`, {data['train_stream_tokens']:,} tokens; "
                     f"evaluated on `{data['eval_data']}`.")
    text = f"""---
license: apache-2.0
library_name: tokenmill
base_model: {base}
---

# {name}

{heads} Medusa heads for `{base}`, trained by tokenmill's `tools/train_medusa.py` with the
target frozen. Use them for speculative decoding:

```python
LLM("{args["target"]}", speculative_config={{"method": "medusa",
    "model": "{args["out"]}", "num_speculative_tokens": {heads}}})
```

## Architecture

Medusa-1 heads on the target's final-normed hidden state h_t (the state whose logits gave the newest
token): head i (0-based) is {args["layers"]} residual block(s) `z + SiLU(W z + b)` (W {stats["hidden_size"]} x
{stats["hidden_size"]}, initialised to zero) followed by the target's lm_head, which all heads share and which
stays frozen (a copy of `{base}`'s output embedding, stored once in `model.safetensors` as
`lm_head.weight`). Head i guesses the token i + 1 places after the newest one; the proposal is the
chain of the heads' argmaxes, verified by the target in one step. {stats["trained_parameters"]:,} trained
parameters; bfloat16 weights. `config.json`: `model_type` "medusa", `hidden_size`, `vocab_size`,
`num_heads`, `num_hidden_layers` (residual blocks per head).

## Data

{textwrap.fill(data_text, 100)}

## Training

Self-distillation: head i at position t learns the target's own teacher-forced next-token
distribution at position t + i + 1 (cross-entropy against the target's softmax), so the heads
predict what the target would say, not what the text says. {args["steps"]} steps of {args["batch"]} x
{args["seq_len"]} tokens ({stats["train_tokens"]:,} tokens), AdamW (betas 0.9/0.95, weight decay 0.1),
peak learning rate {float(args["lr"]):g} with 50 warm-up steps and cosine decay to 10%, gradient clipping
1.0, bfloat16 autocast over float32 weights, seed {args["seed"]}, {args["threads"]} CPU thread(s):
{stats["train_seconds"] / 60:.1f} minutes wall clock on {summary["machine"]} (a machine shared with
other work while it ran, so the time is an upper bound). Reproduce with

```
.venv/bin/python tools/train_medusa.py --target {args["target"]} --out {args["out"]} \\
    --steps {args["steps"]} --batch {args["batch"]} --seed {args["seed"]}
```

## Acceptance (greedy)

At {m["positions"]:,} evenly spaced positions t of the held-out plays, each with the {m["context"]} tokens
before it as context: the target's greedy continuation g_0, g_1, ... from x_<=t (g_0, the newest
token, is its argmax at t); head i is accepted when its argmax from h_t equals g_(i+1). With k heads,
a greedy step takes 1 + the number of leading heads accepted tokens (mean accepted length, the upper
bound of a step's speed-up before the cost of verifying and proposing). Weights as stored (bfloat16)
evaluated in float32.

| head i | guesses the token after the newest at | accepted | mean accepted length with heads 0..i (k = i + 1) |
|---|---|---|---|
{rows}

## Licence

Trained on Shakespeare's works as Project Gutenberg eBooks (public domain, header and licence text
stripped). The weights and this card are part of tokenmill and released under its licence, Apache-2.0.
"""
    (out / "README.md").write_text(text)


if __name__ == "__main__":
    main()
