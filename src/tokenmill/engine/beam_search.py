"""Beam search as a front end over the engine, the way vLLM v1 does `LLM.beam_search`, with the
rules of transformers' beam search (`generate(num_beams=W, do_sample=False, early_stopping=False)`)
for which hypotheses live, finish and are returned.

Each step, every live beam is one engine request: its prompt is the original prompt plus the beam's
tokens, and it asks for one token with the logprobs of the top K candidates, K = 2 * beam_width
((1 + number of EOS ids) * beam_width with several EOS ids, as transformers keeps). The beams share KV
blocks copy-on-write (the PagedAttention paper's case): each step request keeps its blocks once
finished (KVSharing.hold), and the next step's request of each beam names the request of the beam
it extends as its KV parent, so it starts from all of the parent's blocks (ref-counted in
core/block_pool.py, a partial last block included) and computes one token; the first beam to write
into a shared partial block gets a copy (the workers copy the block's KV). Once the next step's
requests are added, the step's blocks are released; nothing of the shared prefix is recomputed,
with or without prefix caching.

The rules (transformers `_beam_search`, early_stopping=False):
- a step's candidates are the top K (beam, token) pairs over all live beams, by cumulative logprob;
- a candidate that ends in EOS (unless ignore_eos) or reaches max_tokens finishes, but only from the
  top beam_width ranks; its score is cum_logprob / generated_len ** length_penalty, generated_len
  counting every generated token, the EOS included;
- the best beam_width candidates that did not finish are the next step's beams;
- the finished set keeps the best beam_width by score, and is what is returned, best first;
- the search ends at max_tokens, or once beam_width hypotheses have finished and the best live beam's
  cum_logprob / generated_len ** length_penalty is no better than the worst of them.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenmill.engine.input_processor import KVSharing
from tokenmill.outputs import PositionLogprobs, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.async_engine import AsyncLLM, RequestStream
    from tokenmill.engine.input_processor import InputProcessor, PromptType
    from tokenmill.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class BeamSearchParams:
    """temperature is accepted as vLLM's BeamSearchParams accepts it; candidates are ranked by the
    model's raw logprobs, so (as in transformers' beam search without sampling) it does not change
    the result."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        checks: list[tuple[bool, str]] = [
            (_is_int(self.beam_width) and self.beam_width >= 1,
             f"beam_width must be an integer >= 1, got {self.beam_width!r}"),
            (_is_int(self.max_tokens) and self.max_tokens >= 1,
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (isinstance(self.ignore_eos, bool), f"ignore_eos must be a bool, got {self.ignore_eos!r}"),
            (_is_num(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0,
             f"temperature must be a finite number >= 0, got {self.temperature!r}"),
            (_is_num(self.length_penalty) and math.isfinite(self.length_penalty),
             f"length_penalty must be a finite number, got {self.length_penalty!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # the prompt's, then the generated ones (EOS included when it ended the beam)
    logprobs: list[PositionLogprobs] = field(default_factory=list)  # per generated token: the top K
    cum_logprob: float = 0.0
    score: float = 0.0  # cum_logprob / generated_len ** length_penalty: the order of the sequences
    text: str | None = None  # the whole sequence decoded, prompt included (as vLLM's LLM.beam_search)
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


@dataclass
class _Beam:
    tokens: list[int]  # generated only
    logprobs: list[PositionLogprobs]
    cum_logprob: float


class BeamSearchState:
    """One prompt's search: `pending()` are the next step's requests (one per live beam), and
    `advance()` takes each one's top-K logprobs for its next position. Both drivers, beam_search (over
    LLMEngine) and beam_search_async (over AsyncLLM), feed it the same way."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams,
                 eos_token_ids: Sequence[int], max_model_len: int) -> None:
        self.prompt = list(prompt_token_ids)
        self.params = params
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.num_candidates = max(2, 1 + len(self.eos)) * params.beam_width
        self.max_tokens = min(params.max_tokens, max_model_len - len(self.prompt))
        self.live = [_Beam([], [], 0.0)]
        self.finished: list[tuple[float, _Beam, str]] = []  # (score, beam, finish reason), best first
        self.done = self.max_tokens < 1
        self.parents: list[int] = [0]  # per live beam: the index, among the step before's, of the beam it extends

    def pending(self) -> list[list[int]]:
        return [] if self.done else [self.prompt + b.tokens for b in self.live]

    def advance(self, position_logprobs: Sequence[PositionLogprobs]) -> None:
        if len(position_logprobs) != len(self.live):
            raise ValueError(f"got logprobs for {len(position_logprobs)} beams, {len(self.live)} are live")
        width, k = self.params.beam_width, self.num_candidates
        candidates = [(beam.cum_logprob + lp.logprob, i, tid)
                      for i, (beam, lps) in enumerate(zip(self.live, position_logprobs, strict=True))
                      for tid, lp in lps.items() if lp.rank is not None and lp.rank <= k]
        candidates.sort(key=lambda c: -c[0])  # stable: equal scores keep beam, then rank order
        generated = len(self.live[0].tokens) + 1
        at_limit = generated >= self.max_tokens
        running: list[_Beam] = []
        parents: list[int] = []
        for rank, (cum, i, tid) in enumerate(candidates[:k]):
            parent = self.live[i]
            beam = _Beam(parent.tokens + [tid], parent.logprobs + [position_logprobs[i]], cum)
            ends = at_limit or tid in self.eos
            if ends and rank < width:
                reason = "stop" if tid in self.eos else "length"
                self.finished.append((cum / generated ** self.params.length_penalty, beam, reason))
            elif not ends and len(running) < width:
                running.append(beam)
                parents.append(i)
        self.finished.sort(key=lambda f: -f[0])
        del self.finished[width:]
        self.live, self.parents = running, parents
        self.done = at_limit or not running or self._cannot_improve(generated)

    def _cannot_improve(self, generated: int) -> bool:
        """transformers' early_stopping=False test: the best live beam, scored at its present length,
        is no better than the worst of beam_width finished hypotheses."""
        if len(self.finished) < self.params.beam_width:
            return False
        best_live = self.live[0].cum_logprob / generated ** self.params.length_penalty
        return best_live <= self.finished[-1][0]

    def result(self, decode: Callable[[list[int]], str] | None = None) -> BeamSearchOutput:
        sequences = []
        for score, beam, reason in self.finished:
            tokens = self.prompt + beam.tokens
            sequences.append(BeamSearchSequence(tokens, beam.logprobs, beam.cum_logprob, score,
                                                decode(tokens) if decode is not None else None, reason,
                                                len(self.prompt)))
        return BeamSearchOutput(sequences)


def step_params(state: BeamSearchState) -> SamplingParams:
    """One beam's request for one step: a token (never used) and the top-K logprobs at its position."""
    return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=state.num_candidates,
                          skip_special_tokens=False, output_kind=RequestOutputKind.FINAL_ONLY)


def position_logprobs(out: RequestOutput) -> PositionLogprobs:
    """The logprobs of a step request's one position; a request that failed is a RuntimeError."""
    completion = out.outputs[0]
    if completion.finish_reason not in ("stop", "length") or not completion.logprobs:
        raise RuntimeError(f"a beam search step failed ({completion.finish_reason}: {completion.stop_reason})")
    return completion.logprobs[0]


def new_search(inputs: InputProcessor, prompt: PromptType, params: BeamSearchParams) -> BeamSearchState:
    """A prompt's search, its prompt tokenized and checked as a request's is."""
    state = BeamSearchState(inputs.tokenize(prompt).prompt_token_ids, params, inputs.eos_token_ids,
                            inputs.config.max_model_len)
    vocab = inputs.config.arch.vocab_size
    if state.num_candidates > vocab:
        raise ValueError(f"beam_width {params.beam_width} needs {state.num_candidates} candidates per step, "
                         f"more than the vocabulary's {vocab} tokens")
    return state


def beam_search(engine: LLMEngine, prompts: Sequence[PromptType], params: BeamSearchParams,
                share_kv: bool = True) -> list[BeamSearchOutput]:
    """Search every prompt at once: each step sends the live beams of all prompts as one batch.
    share_kv=False computes each step request apart (its prefix only through the prefix cache)."""
    states = [new_search(engine.input_processor, prompt, params) for prompt in prompts]
    kept: dict[int, list[str]] = {}  # per state (by index): its live beams' step requests, whose blocks are kept
    try:
        while live := [(n, s) for n, s in enumerate(states) if not s.done]:
            requests = [(s, ids, _sharing(kept.get(n), s, b, share_kv))
                        for n, s in live for b, ids in enumerate(s.pending())]
            request_ids, outputs = _run_step(engine, requests, [i for ids in kept.values() for i in ids])
            spans: list[tuple[int, int]] = []  # each live state's requests: [start, end) in the step's
            for _, state in live:
                start = spans[-1][1] if spans else 0
                spans.append((start, start + len(state.live)))
            # all kept before any advance, which may raise: the finally releases them
            kept = {n: request_ids[a:b] if share_kv else [] for (n, _), (a, b) in zip(live, spans, strict=True)}
            for (_, state), (a, b) in zip(live, spans, strict=True):
                state.advance([position_logprobs(o) for o in outputs[a:b]])
    finally:  # an interrupted search too leaves no kept block behind
        engine.release_kv([i for ids in kept.values() for i in ids])
    decode = _decoder(engine.get_tokenizer())
    return [s.result(decode) for s in states]


async def beam_search_async(engine: AsyncLLM, prompt: PromptType, params: BeamSearchParams) -> BeamSearchOutput:
    """One prompt's search over the server's AsyncLLM: each step's beams are concurrent requests, so
    they pass its admission limits as beam_width requests (QueueFullError when they do not fit)."""
    state = new_search(engine.input_processor, prompt, params)
    kept: list[str] = []
    try:
        while not state.done:
            ids = [f"beam-{uuid.uuid4().hex}" for _ in state.live]
            streams: list[RequestStream] = []
            try:
                for b, (token_ids, rid) in enumerate(zip(state.pending(), ids, strict=True)):
                    streams.append(engine.add_request({"prompt_token_ids": token_ids}, step_params(state), rid,
                                                      kv=_sharing(kept, state, b, True)))
            except BaseException:  # (QueueFullError): the ones added are aborted
                for stream in streams:
                    stream.abort()
                raise
            finally:  # the requests added have forked the parents' blocks they need
                engine.release_kv(kept)
                kept = ids
            tasks = [asyncio.ensure_future(_final_output(stream)) for stream in streams]
            try:
                outputs = await asyncio.gather(*tasks)
            except BaseException:  # one failed (or the caller cancelled): the others are aborted
                for task in tasks:
                    task.cancel()
                for stream in streams:
                    stream.abort()
                raise
            state.advance([position_logprobs(o) for o in outputs])
    finally:
        engine.release_kv(kept)
    return state.result(_decoder(engine.get_tokenizer()))


def _sharing(kept: list[str] | None, state: BeamSearchState, beam: int, share_kv: bool) -> KVSharing | None:
    """A step request's KV sharing: kept once finished, started from the blocks of the request of the
    beam it extends (none on the first step)."""
    if not share_kv:
        return None
    return KVSharing(hold=True, parent=kept[state.parents[beam]] if kept else None)


async def _final_output(stream: RequestStream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    if last is None:
        raise RuntimeError("a beam search step request ended without an output")
    return last


def _decoder(tokenizer: Any) -> Callable[[list[int]], str] | None:
    return None if tokenizer is None else (lambda ids: str(tokenizer.decode(ids)))


def _run_step(engine: LLMEngine, requests: list[tuple[BeamSearchState, list[int], KVSharing | None]],
              release: list[str]) -> tuple[list[str], list[RequestOutput]]:
    """Add the step's requests, release the kept blocks of `release` (the requests just added share
    what they need of them), run the engine until every request is answered."""
    ids: list[str] = []
    results: dict[str, RequestOutput] = {}
    try:
        for state, token_ids, kv in requests:
            ids.append(engine.add_request(None, {"prompt_token_ids": token_ids}, step_params(state), kv=kv))
        engine.release_kv(release)
        while engine.has_unfinished_requests():
            results.update((o.request_id, o) for o in engine.step() if o.finished)
    except BaseException:  # an interrupted search leaves no request (and no KV block) behind
        engine.abort_request([i for i in ids if i not in results])
        engine.release_kv(release + ids)
        raise
    missing = [i for i in ids if i not in results]
    if missing:
        engine.release_kv(ids)
        raise RuntimeError(f"the engine finished without answering beam search step requests {missing}")
    return ids, [results[i] for i in ids]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
