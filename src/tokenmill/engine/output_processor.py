"""EngineCoreOutputs -> RequestOutputs: detokenize, apply stop strings (held back from
streams until they cannot be the start of a stop string), build logprobs, aggregate n>1."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.core.messages import EngineCoreOutput, LogprobEntry
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class ChildState:
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    sent_text: int = 0  # characters already handed out (DELTA)
    sent_tokens: int = 0
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def visible_len(self) -> int:
        if self.finish_reason is not None or not self.params.stop:
            return len(self.text)
        hold = max(len(s) for s in self.params.stop) - 1
        return max(self.sent_text, len(self.text) - hold)


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: dict[str, ChildState]
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, str] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, child_ids: list[str], arrival_time: float) -> None:
        children = {}
        for i, cid in enumerate(child_ids):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
            children[cid] = ChildState(i, params, detok, logprobs=[] if params.logprobs is not None else None,
                                       cumulative_logprob=0.0 if params.logprobs is not None else None)
            self.child_to_parent[cid] = request_id
        prompt_lp: list[PositionLogprobs | None] | None = None
        if params.prompt_logprobs is not None:
            prompt_lp = [None] * len(prompt_token_ids)
        self.parents[request_id] = ParentState(request_id, prompt, prompt_token_ids, params, children,
                                               RequestMetrics(arrival_time), prompt_lp)

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return list(parent.children) if parent else []

    def record_scheduled(self, scheduled: dict[str, float]) -> list[tuple[str, float]]:
        """Sets first_scheduled_time from the core's (child id -> when it was first scheduled);
        returns the (request id, time) of the requests that got theirs now."""
        recorded = []
        for child_id, when in scheduled.items():
            request_id = self.child_to_parent.get(child_id)
            if request_id is None:
                continue  # finished or aborted meanwhile
            metrics = self.parents[request_id].metrics
            if metrics.first_scheduled_time is None:  # n > 1: the first child scheduled
                metrics.first_scheduled_time = when
                recorded.append((request_id, when))
        return recorded

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the RequestOutputs to publish and the child ids the core must stop
        (they hit a stop string)."""
        now = time.time()
        touched: dict[str, ParentState] = {}
        to_stop: list[str] = []
        for out in outputs:
            pid = self.child_to_parent.get(out.request_id)
            if pid is None:
                continue
            parent = self.parents[pid]
            child = parent.children[out.request_id]
            if child.finish_reason is not None:
                continue
            if self._apply(parent, child, out, now):
                to_stop.append(out.request_id)
            touched[pid] = parent
        results = []
        for parent in touched.values():
            result = self._make_output(parent)
            if result is not None:
                results.append(result)
            if parent.finished:
                parent.metrics.finished_time = now
                for cid in parent.children:
                    self.child_to_parent.pop(cid, None)
                del self.parents[parent.request_id]
        return results, to_stop

    def _apply(self, parent: ParentState, child: ChildState, out: EngineCoreOutput, now: float) -> bool:
        m = parent.metrics
        parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
        if out.prompt_logprobs is not None and parent.prompt_logprobs is not None:
            for k, entry in enumerate(out.prompt_logprobs):
                parent.prompt_logprobs[out.prompt_logprobs_start + k] = self._logprobs(entry)
        if out.new_token_ids:
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
        tokens, stopped = out.new_token_ids, False
        if child.detok is not None:
            tokens, stopped = self._detokenize(child, tokens)
        child.token_ids.extend(tokens)
        if out.new_logprobs is not None and child.logprobs is not None:
            for entry in out.new_logprobs[:len(tokens)]:
                child.logprobs.append(self._logprobs(entry))
                child.cumulative_logprob = (child.cumulative_logprob or 0.0) + entry[1][0]
        if out.finish_reason is not None and not stopped:
            child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
        return stopped

    def _detokenize(self, child: ChildState, tokens: list[int]) -> tuple[list[int], bool]:
        """Adds the tokens to the child's text. Where one completes a stop string: the tokens up to it
        and True, so that a step that took several (accepted drafts) stops where one at a time would."""
        assert child.detok is not None
        if len(tokens) == 1 or not child.params.stop:
            before = len(child.text)
            child.text += child.detok.add_tokens(tokens)
            return tokens, self._check_stop_strings(child, before)
        for k, tid in enumerate(tokens):
            before = len(child.text)
            child.text += child.detok.add_tokens([tid])
            if self._check_stop_strings(child, before):
                return tokens[:k + 1], True
        return tokens, False

    @staticmethod
    def _check_stop_strings(child: ChildState, before: int) -> bool:
        stops = child.params.stop
        if not stops or child.finish_reason is not None:
            return False
        longest = max(len(s) for s in stops)
        start = max(0, before - longest + 1)
        best: tuple[int, str] | None = None
        for s in stops:
            i = child.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        child.text = child.text[: i + len(s)] if child.params.include_stop_str_in_output else child.text[:i]
        child.finish_reason, child.stop_reason = "stop", s
        return True

    def _logprobs(self, entry: LogprobEntry) -> PositionLogprobs:
        ids, lps, ranks = entry
        return {tid: Logprob(lp, rank, self._decode_one(tid)) for tid, lp, rank in zip(ids, lps, ranks, strict=False)}

    def _decode_one(self, tid: int) -> str | None:
        return None if self.tokenizer is None else str(self.tokenizer.decode([tid]))

    def _make_output(self, parent: ParentState) -> RequestOutput | None:
        kind = parent.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not parent.finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        completions = []
        for child in parent.children.values():
            visible = child.visible_len()
            if delta:
                text = child.text[child.sent_text:visible]
                tokens = child.token_ids[child.sent_tokens:]
                logprobs = child.logprobs[child.sent_tokens:] if child.logprobs is not None else None
                if not text and not tokens and child.finish_reason is None and child.sent_tokens:
                    continue
            else:
                text, tokens, logprobs = child.text[:visible], list(child.token_ids), child.logprobs
            child.sent_text, child.sent_tokens = visible, len(child.token_ids)
            completions.append(CompletionOutput(child.index, text, tokens, child.cumulative_logprob,
                                                logprobs, child.finish_reason, child.stop_reason))
        if not completions:
            return None
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, completions,
                             parent.finished, parent.prompt_logprobs, parent.metrics, parent.num_cached_tokens)

    def abort(self, request_id: str) -> RequestOutput | None:
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children.values():
            if child.finish_reason is None:
                child.finish_reason = "abort"
        parent.metrics.finished_time = time.time()
        result = self._make_output(parent)
        for cid in parent.children:
            self.child_to_parent.pop(cid, None)
        del self.parents[request_id]
        return result
