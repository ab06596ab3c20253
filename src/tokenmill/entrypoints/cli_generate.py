"""`tokenmill generate --model PATH "prompt"`: print a completion."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tokenmill.config import EngineArgs


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("generate", help="complete one or more prompts offline")
    p.add_argument("prompts", nargs="+", help="prompt text (several prompts run as one batch)")
    p.add_argument("--model", required=True, help="path of a Hugging Face checkpoint directory")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--chat", action="store_true", help="send each prompt as a user message through the chat template")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, stop=args.stop)
    engine_args = EngineArgs.from_cli_args(args)
    kwargs = {k: v for k, v in vars(engine_args).items() if k != "model"}
    llm = LLM(model=args.model, **kwargs)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, use_tqdm=False)
    else:
        outs = llm.generate(args.prompts, params, use_tqdm=False)
    for i, out in enumerate(outs):
        if len(outs) > 1:
            print(f"--- [{i}] finish_reason={out.outputs[0].finish_reason}")
        sys.stdout.write(out.outputs[0].text + "\n")
    return 0
