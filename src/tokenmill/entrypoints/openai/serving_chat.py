"""POST /v1/chat/completions: messages through the chat template, n choices, logprobs with
top_logprobs, streaming deltas (role first, then content, one chunk with finish_reason)."""

from __future__ import annotations

import difflib
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from tokenmill.engine.async_engine import RequestStream
from tokenmill.engine.input_processor import ProcessedPrompt
from tokenmill.entrypoints.openai.errors import bad_request
from tokenmill.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    CompletionTokensDetails,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)
from tokenmill.entrypoints.openai.serving_engine import (
    MIN_JSON_LOGPROB,
    REQUEST_ID_HEADER,
    OpenAIServing,
    collect_final,
    json_logprob,
    merge_streams,
    prompt_logprobs_json,
    sse_stream,
)
from tokenmill.entrypoints.openai.serving_tools import (
    ToolCallStream,
    ToolPlan,
    answer,
    conversation,
    finish_reason,
    plan_tools,
    template_takes_tools,
)
from tokenmill.entrypoints.streaming import AbortingStreamingResponse
from tokenmill.outputs import CompletionOutput, PositionLogprobs


class OpenAIServingChat(OpenAIServing):
    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_request(req, 1)
        await self.constraints_ready(req)
        ids = self.request_ids(raw, req, "chatcmpl")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        if req.stream and req.prompt_logprobs is not None:  # as vLLM: they come with the whole answer
            raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
        plan = plan_tools(list(req.tools or []), req.tool_choice, req.parallel_tool_calls, self.ctx.tool_call_parser,
                          self.ctx.enable_auto_tool_choice, self.grammar_backend)
        prompt = self.render(req.messages, req.add_generation_prompt, req.continue_final_message,
                             req.chat_template_kwargs, req.truncate_prompt_tokens, plan)
        param = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
        requested = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
        max_tokens = self.max_tokens(len(prompt.prompt_token_ids), requested, param)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, logprobs, req.prompt_logprobs, bool(req.stream),
                                      plan.constraint)
        prediction = self._prediction(req)
        if prediction:
            params = params.clone(prediction_token_ids=prediction)
        transfer = self.kv_transfer_params(req, 1)
        streams = self.submit([prompt], [params], ids.engine_id, req.priority, raw, transfer)
        headers = {REQUEST_ID_HEADER: ids.header}
        if req.stream:
            return AbortingStreamingResponse(sse_stream(self._stream(ids.response_id, req, prompt, streams, plan,
                                                             prediction)),
                                     media_type="text/event-stream", headers=headers)
        [final] = await self.guard(raw, collect_final(streams))
        choices = []
        for c in final.outputs:
            content, calls = answer(plan, c.text)
            choices.append(ChatChoice(index=c.index, message=AssistantMessage(content=content, tool_calls=calls),
                                      logprobs=self._logprobs(c, req.top_logprobs or 0) if req.logprobs else None,
                                      finish_reason=finish_reason(plan, c.finish_reason, bool(calls)),
                                      stop_reason=c.stop_reason))
        prompt_lp = None
        if req.prompt_logprobs is not None and final.prompt_logprobs:
            prompt_lp = prompt_logprobs_json(final.prompt_logprobs, lambda t, _: str(self.tokenizer.decode([t])))
        response = ChatCompletionResponse(id=ids.response_id, model=self.ctx.model_name, choices=choices,
                                          usage=_usage(prompt, sum(len(c.token_ids) for c in final.outputs),
                                                       prediction, [c.token_ids for c in final.outputs]),
                                          prompt_logprobs=prompt_lp)
        body = response.model_dump()
        kv_answer = self.kv_transfer_answer(transfer, ids.engine_id, [c.finish_reason for c in final.outputs])
        if kv_answer is not None:
            body["kv_transfer_params"] = kv_answer
        return JSONResponse(body, headers=headers)

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               continue_final_message: bool = False, kwargs: dict[str, Any] | None = None,
               truncate: int | None = None, plan: ToolPlan | None = None) -> ProcessedPrompt:
        ids = self.template_ids(messages, add_generation_prompt, continue_final_message, kwargs, plan)
        return self.tokenize(ids, param="messages", truncate=truncate)

    def template_ids(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                     continue_final_message: bool = False, kwargs: dict[str, Any] | None = None,
                     plan: ToolPlan | None = None) -> list[int]:
        template = self.ctx.chat_template or getattr(self.tokenizer, "chat_template", None)
        takes_tools = template_takes_tools(template if isinstance(template, str) else None)
        conv, tools = conversation(messages, plan, takes_tools)
        extra = dict(kwargs or {})
        if tools is not None:
            extra["tools"] = tools
        try:
            ids = self.tokenizer.apply_chat_template(
                conv, chat_template=self.ctx.chat_template, tokenize=True, return_dict=False,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                **extra)
        except Exception as e:  # jinja, transformers and bad kwargs raise many types
            raise bad_request(f"cannot apply the chat template: {e}", "messages") from None
        return [int(t) for t in ids]

    async def _stream(self, request_id: str, req: ChatCompletionRequest, prompt: ProcessedPrompt,
                      streams: list[RequestStream], plan: ToolPlan,
                      prediction: list[int] | None = None) -> AsyncIterator[str]:
        created, model = int(time.time()), self.ctx.model_name
        opts = req.stream_options
        continuous = bool(opts and opts.continuous_usage_stats)
        finished: set[int] = set()
        tool_streams = {i: ToolCallStream(plan) for i in range(req.n)}
        completion_tokens = 0
        tokens: dict[int, list[int]] = {}  # per choice, for the prediction's figures
        first = True

        def chunk(choices: list[ChatStreamChoice]) -> str:
            usage = _usage(prompt, completion_tokens) if continuous else None
            return ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices,
                                       usage=usage).model_dump_json()

        async for _, out in merge_streams(streams, self.ctx.request_timeout):
            if first:
                first = False
                yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                             for i in range(req.n)])
            choices = []
            for c in out.outputs:
                if c.index in finished:
                    continue  # a finished choice of n>1 shows up again while its siblings run
                if c.finish_reason is not None:
                    finished.add(c.index)
                completion_tokens += len(c.token_ids)
                if prediction:
                    tokens.setdefault(c.index, []).extend(c.token_ids)
                tools = tool_streams[c.index]
                content, calls = tools.feed(c.text, c.finish_reason is not None)
                if not content and not calls and c.finish_reason is None and not (req.logprobs and c.token_ids):
                    continue
                choices.append(ChatStreamChoice(
                    index=c.index, delta=DeltaMessage(content=content, tool_calls=calls or None),
                    logprobs=self._logprobs(c, req.top_logprobs or 0) if req.logprobs else None,
                    finish_reason=finish_reason(plan, c.finish_reason, tools.has_calls), stop_reason=c.stop_reason))
            if choices:
                yield chunk(choices)
        if opts and opts.include_usage:
            yield ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                      usage=_usage(prompt, completion_tokens, prediction,
                                                   list(tokens.values()))).model_dump_json()

    def _prediction(self, req: ChatCompletionRequest) -> list[int] | None:
        """The tokens of the request's Predicted Outputs text, None where it has none."""
        if req.prediction is None:
            return None
        content = req.prediction.content
        text = content if isinstance(content, str) else "".join(part.text for part in content)
        return self.tokenize_text(text, add_special_tokens=False, param="prediction") or None

    def _logprobs(self, comp: CompletionOutput, top: int) -> ChatLogprobs:
        content = []
        for tid, entry in zip(comp.token_ids, comp.logprobs or []):
            tops = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:top]
            token = self._token(tid, entry)
            content.append(TokenLogprob(
                token=token, logprob=json_logprob(entry[tid].logprob) if tid in entry else MIN_JSON_LOGPROB,
                bytes=list(token.encode()),
                top_logprobs=[TopLogprob(token=(s := self._token(t, entry)), logprob=json_logprob(e.logprob),
                                         bytes=list(s.encode())) for t, e in tops]))
        return ChatLogprobs(content=content)

    def _token(self, tid: int, entry: PositionLogprobs) -> str:
        e = entry.get(tid)
        if e is not None and e.decoded_token is not None:
            return str(e.decoded_token)
        return str(self.tokenizer.decode([tid]))


def _usage(prompt: ProcessedPrompt, completion_tokens: int, prediction: list[int] | None = None,
           completions: list[list[int]] | None = None) -> UsageInfo:
    n = len(prompt.prompt_token_ids)
    usage = UsageInfo(prompt_tokens=n, completion_tokens=completion_tokens, total_tokens=n + completion_tokens)
    if prediction:
        accepted = sum(prediction_matches(prediction, c) for c in completions or [[]])
        usage.completion_tokens_details = CompletionTokensDetails(
            accepted_prediction_tokens=accepted,
            rejected_prediction_tokens=len(prediction) * max(1, len(completions or [])) - accepted)
    return usage


def prediction_matches(prediction: list[int], completion: list[int]) -> int:
    """How many of the prediction's tokens appear in the completion, in order (difflib's matching blocks)."""
    matcher = difflib.SequenceMatcher(None, prediction, completion, autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks())
