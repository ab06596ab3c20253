"""POST /v1/completions: one or many prompts (text or token ids), n choices each, echo with
prompt logprobs (lm-eval's loglikelihood scoring, max_tokens=0 included), streaming."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from tokenmill.engine.async_engine import QueueFullError, RequestStream
from tokenmill.engine.beam_search import BeamSearchParams, beam_search_async
from tokenmill.engine.input_processor import ProcessedPrompt
from tokenmill.entrypoints.openai.errors import APIError, bad_request
from tokenmill.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprob,
    UsageInfo,
)
from tokenmill.entrypoints.openai.serving_engine import (
    REQUEST_ID_HEADER,
    OpenAIServing,
    RequestIds,
    collect_final,
    json_logprob,
    merge_streams,
    prompt_logprobs_json,
    sse_stream,
)
from tokenmill.entrypoints.streaming import AbortingStreamingResponse
from tokenmill.outputs import CompletionOutput, PositionLogprobs, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        items = _prompt_items(req.prompt)
        self.check_request(req, len(items))
        await self.constraints_ready(req)
        ids = self.request_ids(raw, req, "cmpl")
        prompts = [self.tokenize(p, req.add_special_tokens, truncate=req.truncate_prompt_tokens) for p in items]
        echo_only = req.max_tokens == 0
        if echo_only and not req.echo:
            raise bad_request("max_tokens must be at least 1 (0 is allowed only with echo)", "max_tokens")
        transfer = self.kv_transfer_params(req, len(prompts))
        if req.use_beam_search:
            return await self._beam_search(req, raw, prompts, ids)
        prompt_logprobs = req.prompt_logprobs if req.prompt_logprobs is not None else (req.logprobs if req.echo
                                                                                       else None)
        params = [self.sampling_params(req, 1 if echo_only else self.max_tokens(len(p.prompt_token_ids),
                                                                                 req.max_tokens),
                                       req.logprobs, prompt_logprobs, bool(req.stream)) for p in prompts]
        streams = self.submit(prompts, params, ids.engine_id, req.priority, raw, transfer)
        view = _ChoiceBuilder(self, req, prompts, echo_only)
        headers = {REQUEST_ID_HEADER: ids.header}
        if req.stream:
            return AbortingStreamingResponse(sse_stream(self._stream(ids.response_id, view, streams)),
                                     media_type="text/event-stream", headers=headers)
        finals = await self.guard(raw, collect_final(streams))
        choices = [view.choice(i, comp, final) for i, final in enumerate(finals) for comp in final.outputs]
        response = CompletionResponse(id=ids.response_id, model=self.ctx.model_name, choices=choices,
                                      usage=view.usage())
        body = response.model_dump()
        answer = self.kv_transfer_answer(transfer, ids.engine_id, [c.finish_reason for c in choices])
        if answer is not None:
            body["kv_transfer_params"] = answer
        return JSONResponse(body, headers=headers)

    async def _beam_search(self, req: CompletionRequest, raw: Request, prompts: list[ProcessedPrompt],
                           ids: RequestIds) -> Response:
        """vLLM's `use_beam_search`: each prompt's n best beams (engine/beam_search.py), not streamed."""
        if req.stream:
            raise bad_request("use_beam_search does not stream; send stream: false", "stream")
        if req.echo or req.logprobs is not None:
            raise bad_request("use_beam_search returns neither echo nor logprobs", "use_beam_search")
        try:
            params = [BeamSearchParams(beam_width=req.n, ignore_eos=req.ignore_eos, length_penalty=req.length_penalty,
                                       max_tokens=self.max_tokens(len(p.prompt_token_ids), req.max_tokens))
                      for p in prompts]
        except ValueError as e:
            raise bad_request(str(e), "use_beam_search") from None
        engine = self.ctx.engine
        searches = [beam_search_async(engine, {"prompt_token_ids": p.prompt_token_ids}, bp)
                    for p, bp in zip(prompts, params, strict=True)]
        try:
            outs = await self.guard(raw, asyncio.gather(*searches))
        except QueueFullError as e:  # each step admits n requests against the queue limits
            raise APIError("rate_limit_exceeded", str(e)) from None
        except ValueError as e:
            raise bad_request(str(e), "use_beam_search") from None
        tokenizer = engine.get_tokenizer()
        choices, completion_tokens = [], 0
        for i, out in enumerate(outs):
            for j, seq in enumerate(out.sequences[:req.n]):
                tokens = seq.output_token_ids
                completion_tokens += len(tokens)
                choices.append(CompletionChoice(index=i * req.n + j, text=tokenizer.decode(tokens),
                                                finish_reason=seq.finish_reason))
        prompt_tokens = sum(len(p.prompt_token_ids) for p in prompts)
        usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          total_tokens=prompt_tokens + completion_tokens)
        response = CompletionResponse(id=ids.response_id, model=self.ctx.model_name, choices=choices, usage=usage)
        return JSONResponse(response.model_dump(), headers={REQUEST_ID_HEADER: ids.header})

    async def _stream(self, request_id: str, view: _ChoiceBuilder,
                      streams: list[RequestStream]) -> AsyncIterator[str]:
        created, model = int(time.time()), self.ctx.model_name
        opts = view.req.stream_options
        finished: set[int] = set()
        async for i, out in merge_streams(streams, self.ctx.request_timeout):
            choices = []
            for comp in out.outputs:
                index = i * view.req.n + comp.index
                if index in finished:
                    continue  # a finished choice of n>1 shows up again while its siblings run
                if comp.finish_reason is not None:
                    finished.add(index)
                choice = view.choice(i, comp, out)
                if choice.text or choice.finish_reason is not None or (choice.logprobs and choice.logprobs.tokens):
                    choices.append(choice)
            if choices:
                usage = view.usage() if opts and opts.continuous_usage_stats else None
                yield CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                         usage=usage).model_dump_json()
        if opts and opts.include_usage:
            yield CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                     usage=view.usage()).model_dump_json()


def _prompt_items(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The prompts of a request: a text, a list of token ids, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("the prompt is empty", "prompt")
    if isinstance(prompt[0], int):
        return [[int(t) for t in prompt]]
    return [p for p in prompt if not isinstance(p, int)]


class _ChoiceBuilder:
    """Turns (prompt index, CompletionOutput) into choices; for streams it is called with
    deltas and keeps per-choice state (prompt echoed yet, logprob text offsets)."""

    def __init__(self, serving: OpenAIServing, req: CompletionRequest, prompts: list[ProcessedPrompt],
                 echo_only: bool) -> None:
        self.serving = serving
        self.req = req
        self.prompts = prompts
        self.echo_only = echo_only
        self.echoed: set[int] = set()
        self.prompt_lp_sent: set[int] = set()
        self.offsets: dict[int, int] = {}
        self.completion_tokens = 0

    def usage(self) -> UsageInfo:
        prompt_tokens = sum(len(p.prompt_token_ids) for p in self.prompts)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=self.completion_tokens,
                         total_tokens=prompt_tokens + self.completion_tokens)

    def choice(self, i: int, comp: CompletionOutput, out: RequestOutput | None = None) -> CompletionChoice:
        index = i * self.req.n + comp.index
        text = ""
        token_ids: list[int] = []
        entries: list[PositionLogprobs | None] = []
        # echo once the prompt logprobs are complete (a chunked prefill sends them in parts)
        if self.req.echo and index not in self.echoed and (comp.token_ids or comp.finish_reason is not None):
            self.echoed.add(index)
            prompt = self.prompts[i]
            text = prompt.prompt if prompt.prompt is not None else self._decode(prompt.prompt_token_ids)
            token_ids = list(prompt.prompt_token_ids)
            plp = out.prompt_logprobs if out is not None else None
            entries = list(plp) if plp else [None] * len(token_ids)
        if not self.echo_only:
            text += comp.text
            token_ids += comp.token_ids
            entries += comp.logprobs or []
            self.completion_tokens += len(comp.token_ids)
        logprobs = None
        if self.req.logprobs is not None:
            logprobs = self._logprobs(index, token_ids, entries)
        prompt_lp = self._prompt_logprobs(index, comp, out)
        if self.echo_only:  # max_tokens=0: the one token generated is not part of the answer
            return CompletionChoice(index=index, text=text, logprobs=logprobs, prompt_logprobs=prompt_lp,
                                    finish_reason="length" if comp.finish_reason else None)
        return CompletionChoice(index=index, text=text, logprobs=logprobs, prompt_logprobs=prompt_lp,
                                finish_reason=comp.finish_reason, stop_reason=comp.stop_reason)

    def _prompt_logprobs(self, index: int, comp: CompletionOutput,
                         out: RequestOutput | None) -> list[dict[str, PromptLogprob] | None] | None:
        """`prompt_logprobs` in vLLM's shape, once per choice (in a stream: with its first tokens, when
        the prompt's logprobs are complete)."""
        if self.req.prompt_logprobs is None or index in self.prompt_lp_sent:
            return None
        if out is None or not out.prompt_logprobs or not (comp.token_ids or comp.finish_reason is not None):
            return None
        self.prompt_lp_sent.add(index)
        return prompt_logprobs_json(out.prompt_logprobs, self._token)

    def _decode(self, ids: list[int]) -> str:
        return str(self.serving.tokenizer.decode(ids))

    def _logprobs(self, index: int, token_ids: list[int], entries: list[PositionLogprobs | None]) -> CompletionLogProbs:
        lp = CompletionLogProbs()
        offset = self.offsets.get(index, 0)
        for tid, entry in zip(token_ids, entries):
            token = self._token(tid, entry)
            lp.tokens.append(token)
            lp.text_offset.append(offset)
            offset += len(token)
            if entry is None or tid not in entry:
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
            else:
                lp.token_logprobs.append(json_logprob(entry[tid].logprob))
                lp.top_logprobs.append({self._token(t, entry): json_logprob(e.logprob) for t, e in entry.items()})
        self.offsets[index] = offset
        return lp

    def _token(self, tid: int, entry: PositionLogprobs | None) -> str:
        if entry is not None and tid in entry and entry[tid].decoded_token is not None:
            return str(entry[tid].decoded_token)
        return self._decode([tid])
