"""`tokenmill run-batch -i in.jsonl -o out.jsonl --model M`: a batch file run offline (vLLM's run_batch).

The input is OpenAI's batch format, one request a line (`custom_id`, `method`, `url`: /v1/completions,
/v1/chat/completions or, for an embedding model, /v1/embeddings, `body`); each answer is appended to the
output file as it finishes, in OpenAI's output format (errors too, with their status code). Run it again
with the same output file and it goes on where it stopped: the custom_ids already there are skipped."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from typing import IO, Any

from tokenmill.config import EngineArgs

RUN_BATCH_ID = "run-batch"  # the group the lines run in (one batch)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("run-batch", help="run an OpenAI batch file offline (resumable)",
                              description=__doc__.split("\n\n", 1)[1] if __doc__ else None)
    p.add_argument("-i", "--input-file", required=True, help="the batch input file (JSONL)")
    p.add_argument("-o", "--output-file", required=True,
                   help="the output file (JSONL); if it exists, the lines whose custom_id it has are skipped")
    p.add_argument("--model", required=True, help="path of a Hugging Face checkpoint directory")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file (or template text)")
    p.add_argument("--lines-in-flight", type=int, default=256, metavar="N",
                   help="requests in the engine at once (default %(default)s)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def done_custom_ids(path: str) -> set[str]:
    """The custom_ids an earlier run answered; a last line cut short by a crash is removed first."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            f.truncate(end)
    done: set[str] = set()
    for line in data[:end].splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("custom_id"), str):
            done.add(record["custom_id"])
    return done


def run(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.cli_serve import load_chat_template

    if args.lines_in_flight < 1:
        raise ValueError(f"--lines-in-flight must be >= 1, got {args.lines_in_flight}")
    try:
        with open(args.input_file, encoding="utf-8") as f:
            texts = [line for line in f.read().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the input file {args.input_file}: {e}") from None
    try:
        done = done_custom_ids(args.output_file)
    except OSError as e:
        raise ValueError(f"cannot open the output file {args.output_file}: {e}") from None
    return asyncio.run(_run(args, texts, done, load_chat_template(args.chat_template)))


async def _run(args: argparse.Namespace, texts: list[str], done: set[str], template: str | None) -> int:
    from tqdm import tqdm

    from tokenmill.entrypoints.openai.api_server import model_names
    from tokenmill.entrypoints.openai.batch_lines import call_app, parse_line

    engine_args = EngineArgs.from_cli_args(args)
    config = engine_args.create_engine_config()
    seen: set[str] = set()
    parsed = [parse_line(t, None, seen) for t in texts]
    todo = [p for p in parsed if p.custom_id not in done or p.error is not None and p.custom_id is None]
    skipped = len(parsed) - len(todo)
    name, aliases = model_names(config.model.served_model_name, config.model.model)
    app, close = await _open_app(args, engine_args, config, name, aliases, template)
    failures = 0
    try:
        with open(args.output_file, "a", encoding="utf-8") as out, \
                tqdm(total=len(todo), disable=not args.progress, unit="req", desc="run-batch") as bar:
            gate = asyncio.Semaphore(args.lines_in_flight)

            async def one(line: Any) -> None:
                nonlocal failures
                if line.error is not None:
                    record, ok = line.error_record, False
                else:
                    async with gate:
                        answer = await call_app(app, line.body, RUN_BATCH_ID)
                    if answer.retry:
                        raise RuntimeError(f"the engine cannot answer: {answer.body}")
                    record, ok = answer.record(line.custom_id), 200 <= answer.status < 300
                _append(out, record)
                failures += not ok
                bar.update(1)

            await asyncio.gather(*(one(p) for p in todo))
    finally:
        await close()
    logging.getLogger(__name__).info("%d lines answered (%d errors), %d skipped as already answered",
                                     len(todo), failures, skipped)
    print(f"run-batch: {len(todo)} lines answered ({failures} errors), {skipped} skipped as already in "
          f"{args.output_file}")
    return 0


def _append(out: IO[str], record: dict[str, Any]) -> None:
    out.write(json.dumps(record) + "\n")
    out.flush()  # a kill loses at most the lines in flight; a cut last line is dropped on resume


async def _open_app(args: argparse.Namespace, engine_args: EngineArgs, config: Any, name: str,
                    aliases: frozenset[str], template: str | None) -> tuple[Any, Any]:
    """The server's app over an in-process engine (the generate engine and its core process, or the
    embedding engine), and how to close it."""
    if config.model.runner == "pooling":
        from tokenmill.engine.pooling_engine import EmbeddingBatcher, EmbeddingEngine
        from tokenmill.entrypoints.openai.embedding_server import build_embedding_app
        from tokenmill.entrypoints.openai.serving_embedding import OpenAIServingEmbedding

        engine = EmbeddingEngine(config)
        batcher = EmbeddingBatcher(engine, 0.002)
        serving = OpenAIServingEmbedding(engine, batcher, name, aliases, 2**31)
        return build_embedding_app(serving, args.model), batcher.shutdown

    from tokenmill.engine.async_engine import AsyncLLM
    from tokenmill.entrypoints.openai.app import build_app
    from tokenmill.entrypoints.openai.serving_engine import ServerContext

    llm = await AsyncLLM.from_engine_args(engine_args, None, logging.getLevelName(logging.getLogger().level))
    ctx = ServerContext(llm, name, aliases, template, None, args.model)
    return build_app(ctx), llm.shutdown
