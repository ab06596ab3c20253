"""Iteration-level scheduler: each step one flat batch of decodes and prefill chunks under a
token budget and a sequence cap; recompute preemption when the KV pool runs out (or swap preemption,
with a second KV tier: core/kv_tiering.py, which also loads prefix blocks the first tier evicted).

Priority classes (`Request.priority_class`): interactive requests come before batch ones in the waiting
queue and in each step's budget; a waiting request of a higher class takes the seat and the blocks of a
running request of a lower class (which is preempted), and under KV pressure the lowest class is
preempted first. While a higher class has requests in the engine, the lower classes' prefill chunks together
get `lower_class_step_tokens` a step on average, so that their work adds little to the higher class's step
time. A pure-decode step runs on the fused decode path and any prefill chunk takes it off that path, so the
lower classes' prefill chunks go only into steps that carry a higher class's prefill anyway, or, once the
lower classes' unspent share has grown to `LOWER_CLASS_BURST_STEPS` steps' worth, into one step that spends
it. Their decode rows go into every step and are not charged to the share: a row more on the fused path
costs the step little, and a share they used up would leave none for the prefills that admit new lines.
Within a class, vLLM's `priority` (lower first) orders requests, then requests of different groups (batches)
take turns (start-time fair queuing over each group's count of requests), then arrival.

Speculative decoding: a request's draft tokens (proposed by the workers with the step before's
output) are scheduled as extra inputs after its last token, and the workers return the drafts they
accepted and one more token; the KV of the rejected ones is rolled back before blocks are cached.

Beam search (engine/beam_search.py): a request with `hold_kv` keeps its blocks once finished (in
`held`, until it is aborted), and a request naming it as `kv_parent` starts from them: at admission
it shares all of them, a partial last block included (KVCacheManager.fork), and only its new tokens
are computed; the first write into a shared block copies it (`SchedulerOutput.blocks_to_copy`).

KV transfer (core/kv_transfer.py): a producer's request keeps its blocks for a consumer, which pulls them;
a consumer's request leaves the waiting queue with its blocks allocated while they come, and comes back as a
request whose prompt is computed, the producer's first token appended.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Iterable

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.block_pool import KVBlock
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_offload import KVOffloadStore
from tokenmill.core.kv_tiering import KVTiering
from tokenmill.core.kv_transfer import KVTransfer
from tokenmill.core.messages import EngineCoreOutput, SchedulerStats, SpecDecodeStats
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sched_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tokenmill.core.structured_output import NoStructuredOutput, StructuredOutput

logger = logging.getLogger(__name__)


LOWER_CLASS_BURST_STEPS = 8  # the most steps' share the lower classes save up for one prefill burst


class Scheduler:
    def __init__(self, sched_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int) -> None:
        self.config = sched_config
        self.max_model_len = sched_config.max_model_len
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # kept sorted by _queue_key
        self.running: list[Request] = []
        self._seen_by_workers: set[str] = set()
        self._finished_ids: set[str] = set()
        self._preempted_since_seen: set[str] = set()
        self.num_preemptions = 0
        self.num_steps = 0  # steps that ran any token, cumulative
        self.spec = SpecDecodeStats()  # speculative decoding's counters, cumulative
        self.structured_output: StructuredOutput = NoStructuredOutput()
        self._structured = False  # a manager other than the no-op is set: ask it and tell it
        self._ended: list[EngineCoreOutput] = []  # requests ended while scheduling, for the next outputs
        self._group_next_round: dict[str, int] = {}  # per group: the turn its next request gets
        self._fair_now = 0  # the latest turn admitted: a group that starts (again) starts here
        self.held: dict[str, list[int]] = {}  # finished hold_kv requests -> the tokens their kept blocks hold
        self.num_scheduled_tokens = 0  # cumulative
        self.num_blocks_copied = 0  # copy-on-write copies, cumulative
        self._lower_credit = 0  # the lower classes' unspent share of the steps, while a higher class is present
        self.tiers: KVTiering | None = None  # the second KV tier, where one is set
        self.transfer: KVTransfer | None = None  # KV transfer between instances, where configured

    def set_structured_output(self, manager: StructuredOutput) -> None:
        # a step's bitmasks follow the tokens taken before it: with async scheduling, a manager that does not
        # wait for the tokens in flight itself (follows_tokens_in_flight) has a constrained request wait while
        # a step that samples for it is in flight (_waits_for_tokens)
        self.structured_output = manager
        self._structured = not isinstance(manager, NoStructuredOutput)

    def set_kv_offload(self, store: KVOffloadStore, swap: bool) -> None:
        """A second KV tier: evicted prefix blocks go to it and are loaded from it; with swap, so do the
        blocks of preempted requests."""
        self.tiers = KVTiering(self.kv, store, swap)

    def set_kv_transfer(self, bytes_per_block: int, *, producer: bool, consumer: bool, transfer_timeout_s: float,
                        hold_timeout_s: float, blocks_per_step: int, layout: str = "") -> KVTransfer:
        """KV transfer with other instances (disaggregated prefill/decode)."""
        self.transfer = KVTransfer(self.kv, bytes_per_block, producer=producer, consumer=consumer,
                                   transfer_timeout_s=transfer_timeout_s, hold_timeout_s=hold_timeout_s,
                                   blocks_per_step=blocks_per_step, held_tokens=self.held.get,
                                   release=self._release_held, layout=layout)
        return self.transfer

    def _release_held(self, request_id: str) -> None:
        if self.held.pop(request_id, None) is not None:
            self.kv.free(request_id)

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.held:
            raise ValueError(f"request id {request.request_id!r} is in use (its KV blocks are kept)")
        if (self.transfer is not None and request.kv_transfer is not None
                and request.sampling_params.structured_outputs is not None):
            self.transfer.release_remote(request)  # its first token must pass the grammar here: computed here
            request.kv_transfer = None
        self.requests[request.request_id] = request
        if request.group:
            request.fair_round = max(self._group_next_round.get(request.group, 0), self._fair_now)
            self._group_next_round[request.group] = request.fair_round + 1
        self._fork(request)
        self._enqueue(request)

    def _fork(self, req: Request) -> None:
        """Start req from its kv_parent's kept blocks when the parent's tokens prefix req's (and leave
        at least one token to compute); else it is computed as any request (prefix cache included)."""
        tokens = self.held.get(req.kv_parent) if req.kv_parent is not None else None
        n = len(tokens) if tokens else 0
        if (n == 0 or n >= req.num_tokens or req.all_token_ids[:n] != tokens
                or req.sampling_params.prompt_logprobs is not None):
            return
        assert req.kv_parent is not None
        self.kv.fork(req.kv_parent, req.request_id, n)
        req.num_computed_tokens = n

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """End requests; a finished request's kept blocks (hold_kv) are released."""
        ids = list(request_ids)
        for rid in ids:
            if self.held.pop(rid, None) is not None:
                self.kv.free(rid)
        return self._end(ids, RequestStatus.FINISHED_ABORTED)

    def fail_requests(self, errors: dict[str, str]) -> list[EngineCoreOutput]:
        """End requests whose step failed, each with its error as the stop reason; their blocks are freed."""
        return self._end(errors, RequestStatus.FINISHED_ERROR, errors)

    def _end(self, request_ids: Iterable[str], status: RequestStatus,
             reasons: dict[str, str] | None = None) -> list[EngineCoreOutput]:
        outputs = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            self._dequeue(req)
            req.stop_reason = reasons.get(rid) if reasons else None
            self._finish(req, status)
            outputs.append(EngineCoreOutput(rid, [], finish_reason=status.finish_reason, stop_reason=req.stop_reason))
        return outputs

    def _dequeue(self, req: Request) -> None:
        """Take an unfinished request out of the running or waiting queue, or out of its KV transfer."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif self.transfer is not None and self.transfer.is_pulling(req.request_id):
            self.transfer.cancel(req.request_id)
        else:
            self.waiting.remove(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._ended) or (
            self.transfer is not None and bool(self.transfer.pulls or self.transfer.has_sends()))

    def only_pulling(self) -> bool:
        """Whether nothing can run until a KV transfer makes progress (the engine may wait on its sockets)."""
        return (not (self.waiting or self.running or self._ended) and self.transfer is not None
                and bool(self.transfer.pulls) and not self.transfer.has_sends())

    def has_predictions(self) -> bool:
        """Whether a running request brings a Predicted Outputs reference text."""
        return any(r.sampling_params.prediction_token_ids for r in self.running)

    def _queue_key(self, req: Request) -> tuple[int, int, int, int, float]:
        # by class; in a class preempted requests go first, then by priority (lower first), then the
        # groups' turns, then by arrival
        return (req.priority_class, 0 if req.status == RequestStatus.PREEMPTED else 1, req.priority,
                req.fair_round, req.arrival_time)

    @staticmethod
    def _remaining(req: Request) -> int:
        """The tokens the request has to compute to reach its end (1 for a decode row)."""
        return req.num_tokens + req.num_output_placeholders - req.num_computed_tokens

    def _is_prefill(self, req: Request) -> bool:
        """Whether the request's next tokens are a prefill chunk (not one decode row, drafts or not)."""
        return not req.spec_token_ids and self._remaining(req) > 1

    def _lower_class_share(self, top: int) -> tuple[int, bool]:
        """The prompt tokens the classes below `top` get in this step together, and whether they may take
        prefill chunks in it: in a step that carries a prefill chunk of the top class anyway, or once their
        unspent share has reached LOWER_CLASS_BURST_STEPS steps' worth (then they get all of it); else decode
        rows only."""
        share = self.config.lower_class_step_tokens
        # running (sorted by class at the step's start) and waiting keep their lowest class last
        if max((q[-1].priority_class for q in (self.running, self.waiting) if q), default=top) == top:
            self._lower_credit = 0
            return share, True
        self._lower_credit = min(self._lower_credit + share, LOWER_CLASS_BURST_STEPS * share)  # >= share
        top_prefill = any(self._is_prefill(r)
                          for r in itertools.takewhile(lambda r: r.priority_class == top, self.running))
        top_prefill = top_prefill or bool(self.waiting and self.waiting[0].priority_class == top
                                          and len(self.running) < self.config.max_num_seqs)
        if top_prefill or self._lower_credit >= LOWER_CLASS_BURST_STEPS * share:
            return self._lower_credit, True
        return share, False

    def _enqueue(self, req: Request) -> None:
        bisect.insort_right(self.waiting, req, key=self._queue_key)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted = False

        spec: dict[str, list[int]] = {}
        sampling: list[Request] = []  # the requests whose tokens this step reaches the end of
        self._make_room_for_higher_classes()
        self.running.sort(key=lambda r: r.priority_class)  # stable: the budget goes to higher classes first
        # the highest class present (the lowest number): running is sorted by class now, waiting always is
        top = min((q[0].priority_class for q in (self.running, self.waiting) if q), default=0)
        lower_left, lower_prefill = self._lower_class_share(top)
        lower_start = lower_left

        def allowed(req: Request) -> int:
            if req.priority_class == top or not self._is_prefill(req):
                return budget  # decode rows of the lower classes are not charged to their share
            if not lower_prefill:
                return 0  # a prefill chunk would take a pure-decode step off the fused path
            return min(budget, lower_left)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.spec_token_ids:
                n, drafts = self._with_drafts(req, allowed(req))
            else:
                n, drafts = min(self._remaining(req), allowed(req), self.max_model_len - req.num_computed_tokens), None
            if n <= 0 or (req.num_output_placeholders and (not self.config.schedule_tokens_in_flight
                                                          or self._ends_with_placeholders(req)
                                                          or self._waits_for_tokens(req))):
                i += 1
                continue
            new_block_ids = self.kv.allocate_slots(req, n)
            while new_block_ids is None:
                victim = self._pick_victim(self.running[i:])
                preempted = True
                self._preempt(victim)
                if victim is req:
                    break
                new_block_ids = self.kv.allocate_slots(req, n)
            if new_block_ids is None:
                continue  # req itself was preempted; self.running shrank at index i
            num_scheduled[req.request_id] = n
            if req.priority_class != top and self._is_prefill(req):
                lower_left -= n
            budget -= n
            if drafts:
                spec[req.request_id] = drafts
            if req.spec_token_ids:
                req.spec_token_ids = []  # scheduled, or cut: the step's output brings new ones
            cached_reqs.append(self._cached_data(req, new_block_ids, self.kv.copied_on_write))
            self._advance(req, n, sampling)
            i += 1

        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            next_req = self._next_waiting()
            if next_req is None or next_req.num_output_placeholders:  # preempted with a step in flight: wait
                break
            req = next_req
            if allowed(req) <= 0:  # a lower class's share of the step is used (the rest of the queue is lower)
                break
            if self.tiers is not None and self.tiers.waits_for_swap(req):  # its blocks' bytes are not in yet
                break
            if self.transfer is not None and self.transfer.wants_pull(req):
                if self._start_pull(req):
                    continue
                if not self.running and self._drop_kept_blocks():
                    continue
                break
            computed, loadable = self._computed(req)
            num_computed = req.num_computed_tokens + len(computed) * self.block_size + loadable
            n = min(req.num_tokens - num_computed, allowed(req))
            block_ids = self.kv.allocate_slots(req, loadable + n, computed)
            if block_ids is None:
                if not self.running and self._drop_kept_blocks():  # nothing runs that could free any
                    continue
                break
            if loadable and self.tiers is not None:  # a disk block that fails its checks is computed
                num_computed -= loadable - self.tiers.load(req, len(computed), loadable)
                n = min(req.num_tokens - num_computed, allowed(req))
            self.waiting.remove(req)
            self._fair_now = max(self._fair_now, req.fair_round)
            if not req.kv_pulled:  # (a pulled request's lookup was counted when it asked for its blocks)
                self.kv.record_prefix_lookup(req, len(computed))
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_computed
            req.num_computed_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_scheduled[req.request_id] = n
            if req.priority_class != top and self._is_prefill(req):
                lower_left -= n
            budget -= n
            if req.request_id in self._seen_by_workers:
                cached_reqs.append(self._cached_data(req, self.kv.block_ids(req.request_id)))
            else:
                self._seen_by_workers.add(req.request_id)
                new_reqs.append(NewRequestData(req.request_id, req.prompt_token_ids, req.sampling_params,
                                               self.kv.block_ids(req.request_id), num_computed,
                                               list(req.output_token_ids)))
            self._advance(req, n, sampling)

        self._lower_credit = max(0, self._lower_credit - (lower_start - lower_left))
        finished, self._finished_ids = self._finished_ids, set()
        if budget < self.config.max_num_batched_tokens:
            self.num_steps += 1
        bitmasks = self.structured_output.grammar_bitmask(sampling, spec) if self._structured and sampling else {}
        copies = self.kv.take_copies()
        self.num_blocks_copied += len(copies)
        self.num_scheduled_tokens += self.config.max_num_batched_tokens - budget
        so = SchedulerOutput(new_reqs, cached_reqs, num_scheduled, self.config.max_num_batched_tokens - budget,
                             finished, spec, bitmasks, copies)
        if self.tiers is not None:
            so.blocks_to_offload, so.blocks_to_load = self.tiers.take()
        if self.transfer is not None:
            so.blocks_to_offload += self.transfer.take_sends()
            loads, so.kv_transfer_reqs = self.transfer.take_loads()
            so.blocks_to_load += loads
        return so

    def _start_pull(self, req: Request) -> bool:
        """Give a consumer's request its prefix hits and fresh blocks for the rest of its prompt, and ask the
        producer for those; False where the pool is short (it waits, as any request)."""
        assert self.transfer is not None
        computed = self.kv.get_computed_blocks(req)
        if self.kv.allocate_slots(req, req.num_prompt_tokens - len(computed) * self.block_size, computed) is None:
            return False
        self.waiting.remove(req)
        self.kv.record_prefix_lookup(req, len(computed))
        req.num_cached_tokens = len(computed) * self.block_size
        self.transfer.start_pull(req, len(computed))
        return True

    def finish_pulls(self) -> None:
        """Requests whose blocks came in take the producer's first token(s) and wait to decode; those whose
        transfer failed compute their prompt here."""
        if self.transfer is None:
            return
        for done in self.transfer.take_done():
            req = done.request
            if req.is_finished or self.requests.get(req.request_id) is not req:
                continue
            if not done.ok:
                logger.warning("KV transfer for %s failed (%s); computing its prompt here", req.request_id,
                               done.reason)
                self.kv.free(req.request_id)
                req.num_computed_tokens = 0
                req.num_cached_tokens = -1
                self._enqueue(req)
                continue
            req.num_computed_tokens = req.num_prompt_tokens
            taken: list[int] = []
            for tok in done.first_token_ids:
                req.append_output_token(tok)
                taken.append(tok)
                if self._check_stop(req, tok):
                    break
            logprobs = done.first_logprobs[:len(taken)] if done.first_logprobs else None
            output = EngineCoreOutput(req.request_id, taken, new_logprobs=logprobs,
                                      num_cached_tokens=max(req.num_cached_tokens, 0))
            if req.is_finished:
                output.finish_reason = req.status.finish_reason
                output.stop_reason = req.stop_reason
                self._finish(req, req.status)
            else:
                self._enqueue(req)
            self._ended.append(output)

    def _computed(self, req: Request) -> tuple[list[KVBlock], int]:
        """A request's first-tier prefix hits, and the tokens after them whose KV the second tier holds
        (a swapped request's own blocks, or more prefix blocks)."""
        if req.num_computed_tokens:  # forked from its kv_parent's blocks
            return [], 0
        swapped = self.tiers is not None and self.tiers.is_swapped(req)
        computed = [] if swapped else self.kv.get_computed_blocks(req)
        loadable = self.tiers.loadable_tokens(req, len(computed)) if self.tiers is not None else 0
        return computed, loadable

    def _drop_kept_blocks(self) -> bool:
        """Release every held request's blocks and the forked blocks of waiting requests (which then
        compute their tokens from the start), so that a waiting request can get blocks; whether any
        block was released."""
        dropped = list(self.held)
        for rid in dropped:
            self.kv.free(rid)
        self.held.clear()
        for req in self.waiting:
            if req.status == RequestStatus.WAITING and req.num_computed_tokens:
                self.kv.free(req.request_id)
                req.num_computed_tokens = 0
                dropped.append(req.request_id)
        return bool(dropped)

    def _make_room_for_higher_classes(self) -> None:
        """Waiting requests of a higher class than some running request (interactive ones over batch
        lines) get what they need for their first chunk, a seat and blocks, by preempting running requests
        of a lower class (the lowest first): lower classes only ever use the capacity higher ones leave."""
        if not self.running or not self.waiting:
            return
        lowest = max(r.priority_class for r in self.running)
        if self.waiting[0].priority_class >= lowest:  # (waiting is sorted by class first)
            return  # nothing waiting outranks anything running (always so with one class of traffic)
        budget = self.config.max_num_batched_tokens
        seats = self.config.max_num_seqs - len(self.running)
        reserved = 0  # free blocks promised to the waiting requests looked at so far
        for req in list(self.waiting):
            if budget <= 0 or req.num_output_placeholders:
                return
            lower = [r for r in self.running if r.priority_class > req.priority_class]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            need = -(-(req.num_computed_tokens + n) // self.block_size) - len(self.kv.block_ids(req.request_id))
            while (seats < 1 or self.kv.num_free_blocks - reserved < need) and lower:
                victim = self._pick_victim(lower)
                lower.remove(victim)
                self._preempt(victim)
                seats += 1
            if seats < 1 or self.kv.num_free_blocks - reserved < need:
                return
            seats -= 1
            reserved += max(need, 0)
            budget -= n

    def _next_waiting(self) -> Request | None:
        """The first waiting request that may be scheduled: with structured output, one whose grammar is
        still compiling is passed over (and one whose grammar fails ends with the error)."""
        if not self._structured:
            return self.waiting[0]
        failed: dict[str, str] = {}
        ready = None
        for req in self.waiting:
            try:
                if self.structured_output.is_ready(req):
                    ready = req
                    break
            except ValueError as e:
                failed[req.request_id] = str(e)
        if failed:
            self._ended += self.fail_requests(failed)
        return ready

    def _waits_for_tokens(self, req: Request) -> bool:
        """A constrained request's bitmask follows its last token: with a step in flight that samples it,
        it waits (async scheduling), unless the manager fills its bitmask once that token is in."""
        return (self._structured and not self.structured_output.follows_tokens_in_flight
                and req.sampling_params.structured_outputs is not None)

    def _with_drafts(self, req: Request, budget: int) -> tuple[int, list[int]]:
        """The tokens to compute for a running request with proposals, and the drafts among them:
        they follow its last token, as many as the budget leaves and as could still be taken (all of
        them and one more within max_tokens and max_model_len)."""
        remaining = req.num_tokens + req.num_output_placeholders - req.num_computed_tokens
        drafts: list[int] = []
        if not req.num_output_placeholders:  # with a step in flight they would not follow its last token
            room = self.max_model_len - req.num_tokens - 1
            if req.sampling_params.max_tokens is not None:
                room = min(room, req.sampling_params.max_tokens - req.num_output_tokens - 1)
            drafts = req.spec_token_ids[:max(room, 0)]
        n = min(remaining + len(drafts), budget, self.max_model_len - req.num_computed_tokens)
        return n, drafts[:max(n - remaining, 0)]

    @staticmethod
    def _advance(req: Request, n: int, sampling: list[Request]) -> None:
        """Count the n scheduled tokens as computed now, so that the next step can be scheduled before
        this one's output is in; a chunk that reaches the last token will sample one more (and req
        joins `sampling`)."""
        req.num_computed_tokens += n
        if req.num_computed_tokens >= req.num_tokens + req.num_output_placeholders:
            req.num_output_placeholders += 1
            sampling.append(req)

    def _ends_with_placeholders(self, req: Request) -> bool:
        """Whether the tokens in flight already take req to max_tokens or max_model_len, so that
        another step would only compute a token to throw away."""
        params = req.sampling_params
        pending = req.num_output_tokens + req.num_output_placeholders
        return (params.max_tokens is not None and pending >= params.max_tokens) or (
            req.num_tokens + req.num_output_placeholders >= self.max_model_len)

    def _cached_data(self, req: Request, new_block_ids: list[int], replaced: bool = False) -> CachedRequestData:
        """What changed for a request the workers hold: its new blocks, or its whole table when it was
        preempted since they saw it or a block of it was `replaced` by a copy."""
        resumed = req.request_id in self._preempted_since_seen
        if resumed:
            self._preempted_since_seen.discard(req.request_id)
        if resumed or replaced:
            new_block_ids = self.kv.block_ids(req.request_id)
        return CachedRequestData(req.request_id, new_block_ids, req.num_computed_tokens, resumed or replaced)

    @staticmethod
    def _pick_victim(candidates: list[Request]) -> Request:
        # the newest among the lowest-priority (highest class, then highest priority value) requests
        # not yet scheduled in this step
        return max(reversed(candidates), key=lambda r: (r.priority_class, r.priority, r.arrival_time))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        if self.tiers is not None:
            self.tiers.swap_out(req)  # its blocks are read out before the step that reuses them runs
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        if req.request_id in self._seen_by_workers:
            self._preempted_since_seen.add(req.request_id)
        self._enqueue(req)

    # ---- after the step ------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        if self.tiers is not None:
            self.tiers.absorb(sched, out)
        if self.transfer is not None:
            self.transfer.sent(sched, out)
        outputs: list[EngineCoreOutput] = self.fail_requests(out.failed) if out.failed else []
        if self._ended:
            outputs, self._ended = self._ended + outputs, []
        sampled = dict(zip(out.req_ids, out.sampled_token_ids, strict=False))
        for rid in sched.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue  # finished (or aborted) while this step ran: what it computed for req is dropped
            new_tokens = sampled.get(rid) or []
            if new_tokens:
                req.num_output_placeholders -= 1
            was_running = req.status == RequestStatus.RUNNING  # else preempted while this step ran
            if was_running:
                drafts = sched.scheduled_spec_decode_tokens.get(rid)
                if drafts and new_tokens:  # the rejected drafts' KV is not the sequence's: not computed
                    req.num_computed_tokens -= len(drafts) + 1 - len(new_tokens)
                    self.spec.observe(len(drafts), len(new_tokens) - 1)
                self.kv.cache_full_blocks(req)
            prompt_lp = out.prompt_logprobs.get(rid)
            if not new_tokens and prompt_lp is None:
                continue
            for k, tok in enumerate(new_tokens):
                req.append_output_token(tok)
                stopped = self._check_stop(req, tok)
                # told one at a time: a grammar that is complete (nothing but a stop token may follow) ends
                # the request at that token, as without drafts
                if self._structured and self.structured_output.accept_tokens(req, [tok]) and not stopped:
                    req.status = RequestStatus.FINISHED_STOPPED
                    stopped = True
                if stopped:  # where one token at a time would have stopped
                    new_tokens = new_tokens[:k + 1]
                    break
            if out.spec_token_ids and was_running and not req.is_finished:
                req.spec_token_ids = out.spec_token_ids.get(rid, [])
            logprobs = out.logprobs.get(rid)
            output = EngineCoreOutput(rid, new_tokens, new_logprobs=logprobs and logprobs[:len(new_tokens)],
                                      num_cached_tokens=max(req.num_cached_tokens, 0))
            if prompt_lp is not None:
                output.prompt_logprobs_start, output.prompt_logprobs = prompt_lp
            if req.is_finished:
                output.finish_reason = req.status.finish_reason
                output.stop_reason = req.stop_reason
                (self.running if was_running else self.waiting).remove(req)
                self._finish(req, req.status)
                if (self.transfer is not None and req.request_id in self.held and req.kv_transfer is not None
                        and req.kv_transfer.do_remote_decode):
                    self.transfer.produced(req, output.new_logprobs)
            outputs.append(output)
        return outputs

    def _check_stop(self, req: Request, tok: int) -> bool:
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and tok in req.eos_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if tok in params.stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = tok
                return True
        if (params.max_tokens is not None and req.num_output_tokens >= params.max_tokens) or (
            req.num_tokens >= self.max_model_len
        ):
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests the front end stopped (e.g. on a stop string)."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            self._dequeue(req)
            self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if req.hold_kv and status.finish_reason in ("stop", "length") and req.request_id in self.kv.req_blocks:
            self.held[req.request_id] = req.all_token_ids[:min(req.num_computed_tokens, req.num_tokens)]
        else:
            self.kv.free(req.request_id)
        if self.tiers is not None:
            self.tiers.forget(req.request_id)
        if self._structured:
            self.structured_output.free(req.request_id)
        del self.requests[req.request_id]
        self._preempted_since_seen.discard(req.request_id)
        if req.request_id in self._seen_by_workers:
            self._seen_by_workers.discard(req.request_id)
            self._finished_ids.add(req.request_id)

    def stats(self) -> SchedulerStats:
        stats = SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage(),
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.pool.num_blocks,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.num_preemptions,
            num_steps=self.num_steps,
            peak_used_blocks=self.kv.pool.peak_used_blocks,
            num_cached_free_blocks=self.kv.pool.num_cached_free_blocks,
            num_scheduled_tokens=self.num_scheduled_tokens,
            num_blocks_copied=self.num_blocks_copied,
            spec_num_drafts=self.spec.num_drafts,
            spec_num_draft_tokens=self.spec.num_draft_tokens,
            spec_num_accepted_tokens=self.spec.num_accepted_tokens,
            spec_num_accepted_tokens_per_pos=list(self.spec.accepted_per_pos),
        )
        if self.tiers is not None:
            self.tiers.count_into(stats)
        if self.transfer is not None:
            self.transfer.count_into(stats)
        return stats

    def step_dropped(self, so: SchedulerOutput) -> None:
        """A step that failed returns no KV bytes: the requests it swapped out are recomputed instead."""
        if self.tiers is not None:
            self.tiers.drop(so)
        if self.transfer is not None:
            self.transfer.dropped(so)
            for rid in so.kv_transfer_reqs:  # its blocks were not written: it computes its prompt after all
                req = self.requests.get(rid)
                if req is None or req.is_finished:
                    continue
                if self.transfer.is_pulling(rid):
                    self.transfer.cancel(rid)
                elif req.status == RequestStatus.WAITING and req in self.waiting:
                    self.waiting.remove(req)
                else:
                    continue  # running: the failed step ends it
                self.kv.free(rid)
                req.num_computed_tokens = 0
                req.num_cached_tokens = -1
                self._enqueue(req)
