"""The grammar backends' common part: core.structured_output.StructuredOutput for the requests whose
SamplingParams carry structured_outputs. A backend (xgrammar_backend.py, guidance.py) supplies its library's
compiler, matchers and bitmask fills through the hooks at the class's end; registry.py names them for
--structured-outputs-config's "backend".

Compilation runs in a thread pool, cached by grammar (an LRU of futures, so requests with the same schema
share one compilation, even while it runs); the scheduler keeps a request waiting until its grammar is
ready (is_ready) and schedules the others. Each request gets its own matcher, advanced with the tokens it
takes; draft tokens are tried and rolled back to build their bitmask rows. A request keeps its matcher
when preempted: recompute preemption keeps its output tokens, so the matcher's state stays its own.

A step's rows without drafts are filled in one call of the library (an xgrammar batch call, or llguidance's
calls row by row; both run without the GIL), once every token before them was told (accept_tokens): with
async scheduling a step is scheduled while the step before it still samples its requests' last tokens, and
gets a Future, queued until the accept_tokens (or free) that tells the last token it needs. The worker
waits for the bitmasks when it samples (the fused CPU decode, inside its one call after the lm_head).

Where the backend fills on the step loop (fill_on_step_loop: the model runs on the CPU, whose cores its
forward's threads occupy, so a fill thread would only take turns with them and with the step loop at the
GIL), a step is filled there: before grammar_bitmask returns, or inside that last accept_tokens. Otherwise
(a GPU) it is filled on a thread of its own, while the step is prepared and its forward runs.

A matcher (the library's, or a wrapper with the same methods) has xgrammar's GrammarMatcher interface:
accept_token (False, state unchanged, for a token the grammar rejects), is_terminated (a stop token was
taken), is_completed (the grammar may end here), rollback and stop_token_ids."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill.core.messages import SchedulerStats
from tokenmill.core.request import Request
from tokenmill.core.structured_output import GrammarBitmasks, bitmask_words
from tokenmill.structured.bitmask import pack_allowed
from tokenmill.structured.grammar import GrammarKey, grammar_key

logger = logging.getLogger(__name__)
DEFAULT_CACHE_SIZE = 128  # compiled grammars kept


@dataclass
class _Matcher:
    matcher: Any  # the backend's (see the module's docstring)
    stop_mask: np.ndarray  # [words] int32: the stop tokens' bits
    next_mask: np.ndarray | None = None  # [words]: the bitmask after the tokens taken, when already filled
    num_accepted: int = 0  # the request's tokens told so far
    freed: bool = False  # the request finished: its rows are never used, and a waiting fill needs no more of it
    terminated: bool = False  # matcher.is_terminated() after the tokens told (and rolled back)


# one step's fill: (request id, its matcher, how many of its tokens come before the row, its drafts)
_FillJob = tuple[str, _Matcher, int, list[int]]
_NO_DRAFTS: list[int] = []  # (never changed)


def _short_of_tokens(jobs: list[_FillJob]) -> dict[str, int]:
    """The jobs' requests that were not told every token before their rows yet: how many they need."""
    return {rid: before for rid, st, before, _ in jobs if not st.freed and st.num_accepted < before}


def _live(state: _Matcher) -> bool:
    """Whether the request's grammar still constrains its next token."""
    return not state.freed and not state.terminated


class GrammarBackend:
    follows_tokens_in_flight = True

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int,
                 cache_size: int = DEFAULT_CACHE_SIZE, compile_threads: int = 1,
                 disable_any_whitespace: bool = False, fill_on_step_loop: bool = False,
                 max_json_whitespace: int | None = None) -> None:
        self._load_tokenizer = load_tokenizer
        self.max_json_whitespace = max_json_whitespace  # grammar.build_grammar's max_whitespace
        self.fill_on_step_loop = fill_on_step_loop
        self.disable_any_whitespace = disable_any_whitespace  # the server's, over every request's
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(compile_threads, thread_name_prefix="tokenmill-grammar")
        # the steps' bitmasks, in the order the steps were scheduled
        self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-bitmask")
        # the steps whose fills wait for tokens, in order (the step loop's alone): (the jobs, the Future the
        # worker waits for, the requests still short of tokens: how many they need); each is filled once the last
        # of them is told
        self._waiting: deque[tuple[list[_FillJob], Future[dict[str, np.ndarray]], dict[str, int]]] = deque()
        self._compiled: OrderedDict[GrammarKey, Future[Any]] = OrderedDict()
        self._matchers: dict[str, _Matcher] = {}
        self.compile_seconds: dict[GrammarKey, float] = {}  # per grammar compiled (the first one includes setup)
        # cumulative, for the metrics: constrained requests by kind, failed grammars, compilations
        self.num_requests: dict[str, int] = {}
        self.num_failed = 0
        self.num_compiles = 0
        self.compile_seconds_total = 0.0

    # ---- compilation -----------------------------------------------------------------------
    def compile(self, key: GrammarKey) -> Future[Any]:
        """The compilation of a grammar, started in the pool unless cached (then it moves to the LRU's end)."""
        future = self._compiled.get(key)
        if future is not None:
            self._compiled.move_to_end(key)
            return future
        future = self._pool.submit(self._compile, key)
        self._compiled[key] = future
        while len(self._compiled) > self.cache_size:
            self._compiled.popitem(last=False)
        return future

    def prepare(self) -> Future[None]:
        """Loads the library and the tokenizer in the pool ahead of the first compilation."""
        return self._pool.submit(self._setup)

    def _compile(self, key: GrammarKey) -> Any:
        start = time.perf_counter()
        try:
            compiled = self._compile_key(key)
        finally:
            seconds = time.perf_counter() - start
            self.num_compiles += 1  # the pool's one thread writes these; the step loop reads them
            self.compile_seconds_total += seconds
        self.compile_seconds[key] = seconds
        return compiled

    # ---- the StructuredOutput seam -----------------------------------------------------------
    def is_ready(self, request: Request) -> bool:
        params = request.sampling_params.structured_outputs
        if params is None or request.request_id in self._matchers:
            return True
        future = self.compile(grammar_key(params, self.disable_any_whitespace))
        if not future.done():
            return False
        error = future.exception()
        if error is not None:
            self.num_failed += 1  # the request ends with the error: asked once
            raise error if isinstance(error, ValueError) else ValueError(f"structured output: {error}")
        self._matchers[request.request_id] = self._new_matcher(future.result(), request)
        self.num_requests[params.kind] = self.num_requests.get(params.kind, 0) + 1
        return True

    def _new_matcher(self, compiled: Any, request: Request) -> _Matcher:
        matcher = self._library_matcher(compiled, list(request.eos_token_ids))
        for tok in request.output_token_ids:  # none but for a request that had tokens before this backend
            matcher.accept_token(tok)
        return _Matcher(matcher, pack_allowed(matcher.stop_token_ids, self.vocab_size),
                        num_accepted=len(request.output_token_ids), terminated=matcher.is_terminated())

    def count_into(self, stats: SchedulerStats) -> None:
        stats.structured_requests = dict(self.num_requests)
        stats.structured_failed = self.num_failed
        stats.grammar_compiles = self.num_compiles
        stats.grammar_compile_seconds = self.compile_seconds_total

    def grammar_bitmask(self, requests: Sequence[Request],
                        drafts: Mapping[str, list[int]]) -> GrammarBitmasks:
        """The step's bitmasks, filled once the constrained requests' tokens before this step (those of the
        steps still in flight too) were told: now, or as a Future, on the step loop or the fill thread."""
        jobs: list[_FillJob] = []
        told = True  # every token before the step told, and no drafts
        for req in requests:
            state = self._matchers.get(req.request_id)
            if state is not None:  # the tokens before this step's: taken, and sampled by the steps in flight
                before = req.num_output_tokens + req.num_output_placeholders - 1
                d = drafts.get(req.request_id, _NO_DRAFTS) if drafts else _NO_DRAFTS
                told = told and not d and state.num_accepted >= before
                jobs.append((req.request_id, state, before, d))
        if not jobs:
            return {}
        if told:  # (this thread tells the tokens) the rows are laid out here, and filled here or by the fill
            # thread, which then makes only the library's calls, which run without the GIL
            out, rows, matchers, fresh = self._lay_out(jobs)
            if not fresh:
                return out
            if self.fill_on_step_loop:
                return self._batch_fill(matchers, rows, fresh, out)
            return self._fill_pool.submit(self._batch_fill, matchers, rows, fresh, out)
        awaited = _short_of_tokens(jobs)
        if not awaited:  # drafts, every token told
            return self._fill_told(jobs) if self.fill_on_step_loop else self._fill_pool.submit(self._fill_told, jobs)
        future: Future[dict[str, np.ndarray]] = Future()
        self._waiting.append((jobs, future, awaited))
        return future

    def _batch_fill(self, matchers: list[Any], rows: np.ndarray, fresh: list[int],
                    out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self._fill_rows(matchers, rows, fresh)
        return out

    def _lay_out(self, jobs: list[_FillJob]) -> tuple[dict[str, np.ndarray], np.ndarray, list[Any], list[int]]:
        """The jobs without drafts: (each one's row, a view of one array: an ended request's all set; that
        array; the matchers of the rows still to be filled (by _fill_rows, which writes each word of a row),
        and those rows' indices in it)."""
        plain = [(rid, st) for rid, st, _, d in jobs if not d]
        rows = np.empty((len(plain), self.words), np.int32)
        out: dict[str, np.ndarray] = {}
        matchers: list[Any] = []
        fresh: list[int] = []
        for k, (rid, st) in enumerate(plain):
            if not _live(st):  # ended: the row is never used
                rows[k] = -1
            elif st.next_mask is not None:
                rows[k] = st.next_mask
            else:
                matchers.append(st.matcher)
                fresh.append(k)
            out[rid] = rows[k:k + 1]
        return out, rows, matchers, fresh

    def _fill_told(self, jobs: list[_FillJob]) -> dict[str, np.ndarray]:
        out, rows, matchers, fresh = self._lay_out(jobs)
        if fresh:  # the rows without drafts, in one call
            self._batch_fill(matchers, rows, fresh, out)
        for rid, st, _, d in jobs:
            if rid in out:
                continue
            if not _live(st):  # ended: the rows are never used
                out[rid] = np.full((1 + len(d), self.words), -1, np.int32)
            else:
                out[rid] = self._rows(st, d)
        return out

    def _rows(self, state: _Matcher, drafts: list[int]) -> np.ndarray:
        """[1 + len(drafts), words]: row j after the first j drafts, as if taken; rows past a draft the
        grammar rejects repeat the row before it."""
        rows = np.empty((1 + len(drafts), self.words), np.int32)
        if state.next_mask is not None:
            rows[0] = state.next_mask
        else:
            self._fill_row(state.matcher, rows, 0)
        taken = 0
        for j, tok in enumerate(drafts):
            if state.matcher.is_terminated() or not state.matcher.accept_token(tok):
                rows[j + 1:] = rows[j]
                break
            taken += 1
            self._fill_row(state.matcher, rows, j + 1)
        if taken:
            state.matcher.rollback(taken)
        return rows

    def accept_tokens(self, request: Request, token_ids: list[int]) -> bool:
        state = self._matchers.get(request.request_id)
        if state is None:
            return False
        try:
            return self._accept(request.request_id, state, token_ids)
        finally:
            state.num_accepted += len(token_ids)
            if self._waiting:
                self._tell_waiting(request.request_id, state.num_accepted)

    def _accept(self, request_id: str, state: _Matcher, token_ids: list[int]) -> bool:
        state.next_mask = None
        matcher = state.matcher
        for tok in token_ids:
            if state.terminated:
                break
            if not matcher.accept_token(tok):
                logger.warning("request %s: token %d breaks its grammar", request_id, tok)
                return True
            state.terminated = matcher.is_terminated()
        if state.terminated:
            return True
        if not matcher.is_completed():
            return False
        # at an end state: the request ends here when nothing but a stop token may follow
        mask = np.empty((1, self.words), np.int32)
        self._fill_row(matcher, mask, 0)
        state.next_mask = mask[0]
        return not np.any(mask[0] & ~state.stop_mask)

    def free(self, request_id: str) -> None:
        state = self._matchers.pop(request_id, None)
        if state is not None:
            state.freed = True
            if self._waiting:
                self._tell_waiting(request_id, None)

    def _tell_waiting(self, request_id: str, num_accepted: int | None) -> None:
        """The request has num_accepted tokens told (None: it was freed): fill each waiting step in turn that now
        has every token it needs, here or on the fill thread."""
        for _, _, awaited in self._waiting:
            before = awaited.get(request_id)
            if before is not None and (num_accepted is None or num_accepted >= before):
                del awaited[request_id]
        while self._waiting and not self._waiting[0][2]:
            jobs, future, _ = self._waiting.popleft()
            if self.fill_on_step_loop:
                self._complete(future, jobs)
            else:
                self._fill_pool.submit(self._complete, future, jobs)

    def _complete(self, future: Future[dict[str, np.ndarray]], jobs: list[_FillJob]) -> None:
        try:
            future.set_result(self._fill_told(jobs))
        except Exception as e:  # (the library's): the worker that waits for the Future raises it
            future.set_exception(e)

    # ---- for speculative decoding ------------------------------------------------------------
    def validate_tokens(self, request_id: str, token_ids: Sequence[int]) -> int:
        """How many of token_ids, in order from the request's current state, the grammar accepts; the
        state is left as it was."""
        state = self._matchers.get(request_id)
        if state is None:
            return len(token_ids)
        n = 0
        for tok in token_ids:
            if state.matcher.is_terminated() or not state.matcher.accept_token(tok):
                break
            n += 1
        if n:
            state.matcher.rollback(n)
        return n

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Undo the last num_tokens tokens accepted for the request (drafts taken before verification)."""
        state = self._matchers.get(request_id)
        if state is not None and num_tokens > 0:
            state.next_mask = None
            state.matcher.rollback(num_tokens)
            state.terminated = state.matcher.is_terminated()
            state.num_accepted -= num_tokens

    def shutdown(self) -> None:
        while self._waiting:  # filled here, as the requests stand: no worker waits for them forever
            jobs, future, _ = self._waiting.popleft()
            self._complete(future, jobs)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._fill_pool.shutdown(wait=False, cancel_futures=True)

    # ---- what a backend supplies (called on the pool's one thread: _setup, _compile_key; on the fill
    # thread and the step loop's: the others) ----------------------------------------------------
    def _setup(self) -> None:
        """Load the library and the tokenizer (once; the first compilation calls it too)."""
        raise NotImplementedError

    def _compile_key(self, key: GrammarKey) -> Any:
        """The compiled grammar of a key, which _library_matcher starts matchers from; a ValueError that
        says what is wrong where the grammar cannot be built."""
        raise NotImplementedError

    def _library_matcher(self, compiled: Any, stop_token_ids: list[int]) -> Any:
        """A new matcher at the grammar's start; stop_token_ids: the request's stop tokens."""
        raise NotImplementedError

    def _fill_row(self, matcher: Any, rows: np.ndarray, index: int) -> None:
        """rows[index] (int32 [n, words], C-contiguous): the matcher's next-token bitmask."""
        raise NotImplementedError

    def _fill_rows(self, matchers: list[Any], rows: np.ndarray, indices: list[int]) -> None:
        """rows[indices[i]]: matchers[i]'s next-token bitmask, in one call of the library where it has one."""
        raise NotImplementedError
