"""Engine steps and fused C++ calls of speculative decoding at batch 1, counted without a clock (so host
load does not enter): every prompt of a `tools/spec_datasets.py` file, greedy, --output-len tokens each,
one JSON line with the steps, the target's fused calls, and the drafts proposed and accepted.

    python tools/spec_counts.py tmp/spec/copy.jsonl '{"method": "ngram", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from tokenmill import LLM, SamplingParams


class CountingOps:
    """The kernels, counting the fused decode entry points called through them."""

    def __init__(self, ops: Any, counts: dict[str, int]) -> None:
        self.ops, self.counts = ops, counts

    def __getattr__(self, name: str) -> Any:
        if name in ("decode_greedy", "decode_layers"):
            self.counts[name] = self.counts.get(name, 0) + 1
        return getattr(self.ops, name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dataset")
    p.add_argument("speculative_config", nargs="?", default=None, help="JSON; none: speculation off")
    p.add_argument("--model", default="models/tokenmill-demo")
    p.add_argument("--output-len", type=int, default=128)
    a = p.parse_args()
    spec = json.loads(a.speculative_config) if a.speculative_config else None
    llm = LLM(a.model, num_threads=1, async_scheduling=False, speculative_config=spec)
    limit = llm.engine.config.model.max_model_len - a.output_len
    tok = llm.get_tokenizer()
    with open(a.dataset, encoding="utf-8") as f:
        prompts: list[Any] = [{"prompt_token_ids": tok.encode(json.loads(line)["prompt"])[-limit:]}
                              for line in f if line.strip()]
    runner = llm.engine.core.executor.runner
    counts: dict[str, int] = {}
    if runner.fused_decode is not None:
        runner.fused_decode.ops = CountingOps(runner.fused_decode.ops, counts)
    params = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
    sched = llm.engine.core.scheduler
    for prompt in prompts:
        llm.generate([prompt], params, use_tqdm=False)
    print(json.dumps({"spec": spec, "steps": sched.num_steps, "target_fused_calls": counts,
                      "draft_tokens": sched.spec.num_draft_tokens, "accepted": sched.spec.num_accepted_tokens}))


if __name__ == "__main__":
    main()
