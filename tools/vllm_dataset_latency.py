"""vLLM-CPU over a `--dataset` file, the way `tokenmill bench latency --dataset` runs one: each prompt of the
file (`{"prompt": text}` a line, tools/spec_datasets.py) at batch 1, greedy, --gen tokens with EOS ignored,
from an empty prefix cache, the median of --runs; speculation from --spec (vLLM's speculative_config as
JSON) or off. It runs in the anchors kit's vLLM venv, with the kit's environment (threads from
VLLM_CPU_OMP_THREADS_BIND, tcmalloc and Intel OpenMP in LD_PRELOAD)::

    HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-0 \\
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$ANCHOR_HOME/vllm-venv/lib/libiomp5.so \\
    $ANCHOR_HOME/vllm-venv/bin/python tools/vllm_dataset_latency.py models/tokenmill-demo copy.jsonl \\
        --spec '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'

Prompts are the model tokenizer's ids of each text, cut to the last max_model_len - gen, as tokenmill's bench
cuts them. Prints one JSON line (vLLM's own logs go to stderr).
"""

import argparse
import json
import os
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("dataset")
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--spec", default="", help="vLLM's speculative_config as JSON (default: off)")
    p.add_argument("--max-model-len", type=int, default=1024)
    a = p.parse_args()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM logs to stdout
    import vllm
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    with open(a.dataset, encoding="utf-8") as f:
        texts = [json.loads(line)["prompt"] for line in f if line.strip()]
    tok = AutoTokenizer.from_pretrained(a.model)
    limit = a.max_model_len - a.gen
    prompts = [{"prompt_token_ids": tok.encode(t)[-limit:]} for t in texts]
    spec = json.loads(a.spec) if a.spec else None
    t0 = time.perf_counter()
    llm = LLM(model=a.model, dtype="bfloat16", seed=0, max_model_len=a.max_model_len, max_num_seqs=8,
              **({"speculative_config": spec} if spec else {}))
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=a.gen, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    walls = []
    for _ in range(a.runs):
        llm.reset_prefix_cache()
        t = time.perf_counter()
        for prompt in prompts:
            got = llm.generate([prompt], params, use_tqdm=False)
            assert len(got[0].outputs[0].token_ids) == a.gen
        walls.append(time.perf_counter() - t)
    wall = statistics.median(walls)
    out.write(json.dumps({
        "engine": "vllm-cpu", "version": vllm.__version__, "bench": "latency", "model": a.model,
        "dataset": a.dataset, "requests": len(prompts), "batch_size": 1, "gen": a.gen, "runs": a.runs,
        "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), "speculative_config": spec,
        "output_tok_s": round(len(prompts) * a.gen / wall, 1), "wall_s": round(wall, 3),
        "wall_s_runs": [round(w, 3) for w in walls], "load_s": round(load_s, 1),
    }) + "\n")
    out.flush()
    del llm  # shuts vLLM's engine process down before exit


if __name__ == "__main__":  # vLLM starts its engine process with spawn
    main()
