"""Turns a SchedulerOutput into tensors, runs the model over the paged KV cache (or the fused decode
path where it applies), samples. The Worker (worker.py) builds it once the KV cache is bound.

On a pipeline stage (`PipelineParallel`) the runner receives the previous stage's hidden states before
its layers and sends its own after them without waiting for them to be taken; the last stage samples and
sends the sampled tokens back to the earlier stages, whose request states (and later steps' inputs) need
them. An earlier stage takes them only when a step it prepares schedules one of those requests (the
engine schedules a request again only once its token is in, so they have been sent by then), or when
more than _MAX_TOKENS_BEHIND steps' tokens wait; meanwhile it runs the steps of other requests."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from tokenmill.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    OutputRows,
    as_decode_rows,
    output_rows,
    to_device,
)
from tokenmill.attention.cpu import CpuBackend
from tokenmill.config import EngineConfig
from tokenmill.core.messages import LogprobEntry
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.core.structured_output import bitmask_words
from tokenmill.distributed import InFlight, PipelineParallel
from tokenmill.kv_cache_spec import KVCacheConfig
from tokenmill.models.interface import IntermediateTensors
from tokenmill.models.loader import TORCH_DTYPES
from tokenmill.spec_decode.proposer import ProposalInput, Proposer
from tokenmill.worker.cuda_graphs import DecodeGraphs, graphable
from tokenmill.worker.fused_decode import FusedDecode
from tokenmill.worker.input_batch import CachedRequestState, StepBatch, build_step, update_states
from tokenmill.worker.kv_cache import KVCacheTensors, copy_blocks, read_blocks, write_blocks
from tokenmill.worker.memory import BackgroundPopulate
from tokenmill.worker.sampler import Sampler, SamplerOutput, host_copy, topn_logprobs
from tokenmill.worker.sampling_metadata import SamplingMetadata, SamplingTable

logger = logging.getLogger(__name__)
# an earlier pipeline stage takes the oldest steps' sampled tokens past this many, needed or not
_MAX_TOKENS_BEHIND = 8


@dataclass
class PreparedStep:
    step: StepBatch | None  # None: every scheduled request failed to prepare
    meta: AttentionMetadata | None
    rows: OutputRows | None  # the rows whose outputs are used, where that is fewer than all
    sampling: SamplingMetadata | None  # the sampled rows' parameters; None: the step samples nothing
    failed: dict[str, str] = field(default_factory=dict)  # scheduled requests left out: their errors
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write, before the step runs
    propose: bool = True  # whether the proposer drafts after this step (SchedulerOutput.propose_drafts)
    blocks_to_offload: list[int] = field(default_factory=list)  # read out first (the second KV tier)
    blocks_to_load: list[tuple[int, bytes]] = field(default_factory=list)  # written in after the copies


@dataclass
class LaunchedStep:
    """A pure-decode greedy step whose kernels are all queued (ModelRunner.launch); finish() waits for its
    tokens."""

    step: StepBatch
    sampling: SamplingMetadata
    host_ids: torch.Tensor  # each row's token, on its way to host memory
    copied: Any  # the event that marks the copy done (None on a CPU)
    start: float  # when the launch began (perf_counter)


@dataclass
class StageTimes:
    """A pipeline stage's seconds, summed over the steps that ran the model: in all (`step_s`), waiting
    for and receiving the previous stage's hidden states (`recv_s`), posting its own (`send_s`); and,
    outside the steps (while preparing them), waiting for and receiving the sampled tokens (`tokens_s`:
    the earlier stages)."""

    steps: int = 0
    step_s: float = 0.0
    recv_s: float = 0.0
    send_s: float = 0.0
    tokens_s: float = 0.0


class ModelRunner:
    # ops: tokenmill's C++ kernels where the worker uses them (Worker.kernels: a bf16 or float32 model), for the
    # sampler's argmax and the fused decode path; None elsewhere
    def __init__(self, config: EngineConfig, model: Any, backend: AttentionBackend, ops: Any,
                 kv_config: KVCacheConfig, kv_caches: KVCacheTensors, pp: PipelineParallel | None = None) -> None:
        self.config = config
        self.pp = pp or PipelineParallel()
        self.stage_times = StageTimes()
        self._sends: list[InFlight] = []  # this stage's sends not known to be complete
        # an earlier stage's steps whose sampled tokens it has not taken yet, oldest first
        self._tokens_behind: deque[_TokensBehind] = deque()
        self.model = model
        self.backend = backend
        self.device = torch.device(config.device.device)
        self.block_size = kv_config.block_size
        self.kv_caches = kv_caches
        # fault the pool in while idle, each group's tensor; begins after the first step
        self._populate = [BackgroundPopulate(t, block_dim=d) for t, d in kv_caches.groups]
        self.states: dict[str, CachedRequestState] = {}
        self.failed: dict[str, str] = {}  # requests whose state could not be built, until they finish
        self.sampling = SamplingTable(config.model.arch.eos_token_ids)  # the states' sampling parameters, one row each
        self.sampler = Sampler(ops)
        self.proposer: Proposer | None = None  # draft tokens for the next step (speculative decoding)
        self._unproposed = False  # a step since the last proposal was not asked to propose
        self._hidden: torch.Tensor | None = None  # the sampled rows' hidden states, for a proposer that needs them
        # a pure-decode step's layer loop in one C++ call where the model and backend allow it
        self.fused_decode = FusedDecode.create(model, ops, backend)
        # on a GPU, pure-decode steps replay CUDA graphs (off with --enforce-eager)
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.device.enforce_eager and graphable(model, backend):
            self.graphs = DecodeGraphs(model, config.scheduler.max_num_seqs, config.scheduler.max_model_len,
                                       self.block_size, self.device)
            with torch.inference_mode():
                self.graphs.capture_all()
        # only the sampled rows through the last layer's attention output and MLP (OutputRows);
        # False runs every row through it, the reference path the tests compare with
        self.output_rows_only = True
        # a step of decodes and verification runs (a request's last token and its drafts, every row
        # sampled) described as decode rows (as_decode_rows), so that the fused decode call or the C++ paged
        # decode takes it: None where either exists (the `cpu` backend with its kernels: without the fused
        # path, as on AVX2, its paged decode beats prefill chunks through SDPA there: bench/README.md); True
        # always (the layer loop over the decode rows, the reference the tests compare the fused path with),
        # False never (verification runs as prefill)
        self.verify_as_decode_rows: bool | None = None
        # (the fused decode path exists only on such a backend: FusedDecode.create)
        self._decode_rows_native = isinstance(backend, CpuBackend) and backend.ops is not None
        # launch(): a pure-decode greedy step queued on the GPU by the thread that prepared it, its pending
        # inputs taken from the device tensor of the tokens the step before samples, so that the GPU runs
        # the next step while those tokens travel to the host. On where decode steps replay graphs; the
        # tests turn it on over a CPU to check it against the worker-thread path
        self.launch_ahead = self.graphs is not None
        self.launched = 0  # steps run by launch()
        self.device_inputs = 0  # of their pending inputs, those taken from the device
        # the last launched step's sampled tokens (device) and, per request, (row, position) of its token
        self._launched_ids: torch.Tensor | None = None
        self._launched_rows: dict[str, tuple[int, int]] = {}

    def set_proposer(self, proposer: Proposer | None) -> None:
        # a request's drafts follow the tokens the step before took: the engine asks for them
        # (SchedulerOutput.propose_drafts) only where that step's output is in before the next is scheduled
        self.proposer = proposer

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute(self.prepare(so))

    def prepare(self, so: SchedulerOutput) -> PreparedStep | None:
        """The step's inputs, built from the states as they are now: for async scheduling this runs while
        the step before is still executing, so a decode row whose token that step samples is left
        pending (StepBatch.pending_inputs) and filled in by execute(). None: nothing to run."""
        if self._tokens_behind:
            self._take_tokens(so)
        update_states(self.states, so, self.device, self.sampling, self.failed)
        if so.finished_req_ids and (done := getattr(self.proposer, "finished", None)) is not None:
            done(so.finished_req_ids)
        if so.scheduled_new_reqs and (added := getattr(self.proposer, "added", None)) is not None:
            for new in so.scheduled_new_reqs:
                added(new.req_id, new.sampling_params)
        failed = {rid: self.failed[rid] for rid in so.num_scheduled_tokens if rid in self.failed}
        if failed:
            so = _without(so, failed)
        offload = [b.block_id for b in so.blocks_to_offload]
        if so.total_num_scheduled_tokens == 0:
            return PreparedStep(None, None, None, None, failed, so.blocks_to_copy, so.propose_drafts, offload,
                                so.blocks_to_load) if failed or so.moves_kv else None
        step = build_step(self.states, so, self.block_size)
        sampling = None
        if step.sample_states:  # gathered here: the next step's prepare may change the table while this runs
            sampling = self.sampling.view(step.sample_req_ids, step.sample_drafts, so.grammar_bitmask, self.device)
            if step.sample_drafts and (q := getattr(self.proposer, "draft_probs", None)):
                sampling.draft_probs = draft_probs_of(step.sample_req_ids, step.sample_drafts, q)
        meta = AttentionMetadata(
            slot_mapping=to_device(torch.from_numpy(step.slot_mapping), self.device),
            query_start_loc=step.query_start_loc, seq_lens=step.seq_lens, block_tables=step.block_tables,
            num_decodes=step.num_decodes, block_size=self.block_size)
        as_rows = self.verify_as_decode_rows
        if (step.sample_drafts and (as_rows or (as_rows is None and self._decode_rows_native))
                and not step.prompt_lp_rows and len(step.logits_indices) == len(step.input_ids)):
            meta = as_decode_rows(meta)  # every row is sampled: decodes and verification runs only
        self.backend.prepare(meta, self.device)
        rows = None
        if self.output_rows_only and not step.prompt_lp_rows and len(step.logits_indices) < len(step.input_ids):
            # only the sampled rows need the last layer's output (prompt logprobs need every row's)
            rows = output_rows(meta, step.logits_indices, step.logits_seqs)
            self.backend.prepare(rows.meta, self.device)
        return PreparedStep(step, meta, rows, sampling, failed, so.blocks_to_copy, so.propose_drafts, offload,
                            so.blocks_to_load)

    def execute(self, prepared: PreparedStep | None) -> ModelRunnerOutput:
        """Run a prepared step; steps must execute in the order they were prepared."""
        if prepared is None:
            return ModelRunnerOutput([], [])
        with self._populate_paused():
            # after every earlier step's writes, before this one's: the blocks evicted or swapped out are read
            # before a copy or a load may write into them, and a copy's source before a load reuses it
            offloaded = read_blocks(self.kv_caches, prepared.blocks_to_offload)
            if prepared.blocks_to_copy:
                copy_blocks(self.kv_caches, prepared.blocks_to_copy)
            write_blocks(self.kv_caches, prepared.blocks_to_load)
            if prepared.step is None or prepared.meta is None:
                return ModelRunnerOutput([], [], failed=prepared.failed, offloaded_kv=offloaded)
            propose = (self.proposer is not None and prepared.propose and bool(prepared.step.sample_states)
                       and getattr(self.proposer, "active", True))
            self._unproposed |= self.proposer is not None and not prepared.propose
            start = time.perf_counter()
            out = self._execute(prepared.step, prepared.meta, prepared.rows, prepared.sampling, propose)
            self.stage_times.steps += 1
            self.stage_times.step_s += time.perf_counter() - start
            if propose:
                step = prepared.step  # measured where it ran decodes and verification runs only
                step_s = time.perf_counter() - start if len(step.logits_indices) == len(step.input_ids) else None
                out.spec_token_ids = self._propose(step, out, step_s)
                out.spec_gated = int(getattr(self.proposer, "gated", 0))
            out.failed = prepared.failed
            out.offloaded_kv = offloaded
            return out

    def _populate_paused(self) -> contextlib.ExitStack:
        """The KV pool's background population held while a step runs (BackgroundPopulate.paused)."""
        stack = contextlib.ExitStack()
        for populate in self._populate:
            stack.enter_context(populate.paused())
        return stack

    def launchable(self, prepared: PreparedStep | None) -> bool:
        """Whether launch() may run this step: launch_ahead is on, and the step is pure decode (graph
        sized where graphs replay), plain greedy with nothing reported beside the tokens, with no KV
        blocks to move, no drafts, no proposer and one pipeline stage."""
        if not self.launch_ahead or prepared is None or prepared.step is None or prepared.meta is None:
            return False
        step, meta, s = prepared.step, prepared.meta, prepared.sampling
        n = len(step.input_ids)
        return (s is not None and s.all_plain_greedy and not s.pending_plain and not s.drafts
                and s.logprobs is None and not prepared.failed and prepared.rows is None
                and not (prepared.blocks_to_copy or prepared.blocks_to_offload or prepared.blocks_to_load)
                and self.proposer is None and self.pp.size == 1 and not step.prompt_lp_rows
                and meta.num_decodes == len(step.logits_indices) == n
                and (self.graphs is None or self.graphs.applies(meta, n)))

    def launch(self, prepared: PreparedStep) -> LaunchedStep | None:
        """Queue a launchable step's kernels and the copy of its tokens to the host, without waiting for
        them. A pending input is taken from the host where its token is in, else from the device tensor
        of the last launched step, which samples it; None (nothing queued) where a pending token is in
        neither: a step on the worker thread samples it, and must be waited for first."""
        step, meta, sampling = prepared.step, prepared.meta, prepared.sampling
        assert step is not None and meta is not None and sampling is not None
        dst: list[int] = []
        src: list[int] = []
        for row, st, pos in step.pending_inputs:
            if pos < len(st.token_ids):
                step.input_ids[row] = st.token_ids[pos]
                continue
            source = self._launched_rows.get(st.req_id)
            if source is None or source[1] != pos:
                return None
            step.input_ids[row] = 0
            dst.append(row)
            src.append(source[0])
        start = time.perf_counter()
        n = len(step.input_ids)
        staged = np.concatenate([step.input_ids, step.positions, np.asarray(dst + src, dtype=np.int64)])
        with self._populate_paused(), torch.inference_mode():
            inputs = to_device(torch.from_numpy(staged), self.device)  # one copy for the step's inputs
            input_ids, positions = inputs[:n], inputs[n:2 * n]
            if dst:
                assert self._launched_ids is not None
                input_ids[inputs[2 * n:2 * n + len(dst)]] = self._launched_ids[inputs[2 * n + len(dst):]]
            if self.graphs is not None:
                hidden = self.graphs.run(input_ids, positions, meta)
            else:
                hidden = self.model(input_ids, positions, meta, None)
            ids = self.model.compute_logits(hidden).argmax(dim=-1)
            host_ids, copied = host_copy(ids)
        self._launched_ids = ids
        positions_list = step.positions.tolist()
        self._launched_rows = {st.req_id: (k, positions_list[k] + 1) for k, st in enumerate(step.sample_states)}
        self.launched += 1
        self.device_inputs += len(dst)
        return LaunchedStep(step, sampling, host_ids, copied, start)

    def finish(self, launched: LaunchedStep) -> ModelRunnerOutput:
        """A launched step's output, once its tokens are in (into the request states, as execute does)."""
        if launched.copied is not None:
            launched.copied.synchronize()
        step = launched.step
        out = ModelRunnerOutput(step.req_ids, [[] for _ in step.req_ids])
        self._record(step, out, self.sampler.from_argmax(launched.host_ids.tolist(), launched.sampling))
        self.stage_times.steps += 1
        self.stage_times.step_s += time.perf_counter() - launched.start
        return out

    @torch.inference_mode()
    def _execute(self, step: StepBatch, meta: AttentionMetadata, rows: OutputRows | None,
                 sampling: SamplingMetadata | None, propose: bool) -> ModelRunnerOutput:
        """The step's tokens; propose: the proposer drafts after it (a proposer that reads hidden states
        gets the sampled rows')."""
        step.fill_pending_inputs()
        input_ids = to_device(torch.from_numpy(step.input_ids), self.device)
        positions = to_device(torch.from_numpy(step.positions), self.device)
        out = ModelRunnerOutput(step.req_ids, [[] for _ in step.req_ids])
        greedy = sampling is not None and sampling.all_argmax  # (over the allowed tokens, with a bitmask)
        keep_hidden = propose and getattr(self.proposer, "needs_hidden_states", False)
        fused, graphs = self.fused_decode, self.graphs
        if graphs is not None and rows is None and graphs.applies(meta, len(step.input_ids)):
            hidden = graphs.run(input_ids, positions, meta)
        elif fused is not None and rows is None and fused.applies(meta, len(step.input_ids)):
            # every row of the step greedy (over its bitmask's tokens): the fused calls give its tokens
            argmax = sampling if (greedy and len(step.logits_indices) == len(step.input_ids)
                                  and not step.prompt_lp_rows) else None
            ids = None
            if argmax is not None and not keep_hidden:  # the whole step in one call
                if argmax.bitmask_ready:
                    argmax.await_bitmask()
                    ids = fused.greedy(input_ids, positions, meta, argmax.bitmask)
                else:  # the call waits for the bitmasks after its lm_head
                    ids = fused.greedy_awaiting(input_ids, positions, meta, argmax,
                                                bitmask_words(self.config.model.arch.vocab_size))
            if ids is None:
                hidden = fused.forward(input_ids, positions, meta)
                if argmax is not None:
                    # a proposer that reads the hidden states, or an lm_head greedy does not take: the forward
                    # first, then the lm_head and argmax in one call
                    argmax.await_bitmask()
                    ids = fused.greedy_from_hidden(hidden, argmax.bitmask)
            if ids is not None and argmax is not None:  # each row's token
                self._hidden = hidden if keep_hidden else None  # (every row sampled, in order)
                self._record(step, out, self.sampler.from_argmax(ids.tolist(), argmax))
                return out
        elif self.pp.size > 1:
            stage_hidden = self._stage_forward(input_ids, positions, meta, rows)
            if stage_hidden is None:  # an earlier stage: the last one samples and sends the tokens back
                if step.sample_states:
                    self._tokens_behind.append(_TokensBehind({st.req_id for st in step.sample_states},
                                                             step.sample_states, self._token_capacity(step)))
                return out
            hidden = stage_hidden
        else:
            hidden = self.model(input_ids, positions, meta, rows)
        if sampling is not None:
            self._sample(hidden, step, out, sampling, keep_hidden)
            if self.pp.size > 1:
                self._share_tokens(step, out)
        for rid, (row0, n, pos0, st) in step.prompt_lp_rows.items():
            out.prompt_logprobs[rid] = (pos0, self._prompt_logprobs(hidden[row0:row0 + n], st, pos0))
        return out

    def _stage_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       rows: OutputRows | None) -> torch.Tensor | None:
        """This stage's layers over the step: the final hidden states on the last stage, None on the
        others (which send theirs on)."""
        pp, times = self.pp, self.stage_times
        intermediate = None
        if not pp.is_first:
            start = time.perf_counter()
            shape = (2, len(input_ids), self.config.model.arch.hidden_size)
            received = pp.recv(shape, TORCH_DTYPES[self.config.model.dtype])
            times.recv_s += time.perf_counter() - start
            intermediate = IntermediateTensors(received[0], received[1])
        result = self.model(input_ids, positions, meta, rows, intermediate)
        if pp.is_last:
            return cast(torch.Tensor, result)
        start = time.perf_counter()
        self._sends = [s for s in self._sends if not s.done()]
        self._sends.append(pp.send(torch.stack([result.hidden, result.residual])))
        times.send_s += time.perf_counter() - start
        return None

    @staticmethod
    def _token_capacity(step: StepBatch) -> list[int]:
        """The most tokens each sampled row takes: one, and one per draft it verifies."""
        return [1 + len(step.sample_drafts.get(k, ())) for k in range(len(step.sample_states))]

    def _share_tokens(self, step: StepBatch, out: ModelRunnerOutput) -> None:
        """The last stage's sampled tokens to the earlier stages (from its first rank only: the others
        sampled the same)."""
        if self.pp.rank == self.pp.output_rank:
            self._sends = [s for s in self._sends if not s.done()]
            self._sends += self.pp.send_tokens([out.sampled_token_ids[p] for p in step.sample_positions],
                                               self._token_capacity(step))

    def _take_tokens(self, so: SchedulerOutput) -> None:
        """An earlier stage's side of _share_tokens, before it prepares `so`: the tokens of the steps up to
        the last one that sampled a request `so` schedules (and of the oldest past _MAX_TOKENS_BEHIND),
        in step order, into the request states, as sampling does."""
        behind = self._tokens_behind
        scheduled = so.num_scheduled_tokens
        needed = max((i + 1 for i, t in enumerate(behind) if any(rid in scheduled for rid in t.req_ids)), default=0)
        start = time.perf_counter()
        for _ in range(max(needed, len(behind) - _MAX_TOKENS_BEHIND)):
            taken = behind.popleft()
            for st, row in zip(taken.states, self.pp.recv_tokens(taken.capacity), strict=True):
                st.token_ids.extend(row)
        self.stage_times.tokens_s += time.perf_counter() - start

    def _sample(self, hidden: torch.Tensor, step: StepBatch, out: ModelRunnerOutput,
                sampling: SamplingMetadata, keep_hidden: bool) -> None:
        if len(step.logits_indices) < hidden.shape[0]:  # the model gave every row's
            hidden = hidden.index_select(0, torch.tensor(step.logits_indices, device=self.device))
        logits = self.model.compute_logits(hidden)  # all rows (a pure-decode step): in order, as they are
        self._hidden = hidden if keep_hidden else None
        sampling.await_bitmask()
        self._record(step, out, self.sampler(logits, sampling))  # (plain greedy rows: the C++ argmax alone)

    @staticmethod
    def _record(step: StepBatch, out: ModelRunnerOutput, sampled: SamplerOutput) -> None:
        """Each sampling request's tokens (and logprobs) into its state and the step's output."""
        rows = zip(step.sample_states, step.sample_positions, sampled.token_ids, strict=False)
        for k, (st, pos, tokens) in enumerate(rows):
            st.token_ids.extend(tokens)
            out.sampled_token_ids[pos] = tokens
            if sampled.row_token_ids:
                first = sampled.first_rows[k]
                step.verified[k] = sampled.row_token_ids[first:first + 1 + len(step.sample_drafts.get(k, ()))]
            if sampled.logprobs and (logprobs := sampled.logprobs[k]) is not None:
                out.logprobs[st.req_id] = logprobs

    def _propose(self, step: StepBatch, out: ModelRunnerOutput, step_s: float | None) -> dict[str, list[int]]:
        assert self.proposer is not None
        states = step.sample_states
        taken = [len(out.sampled_token_ids[p]) for p in step.sample_positions]
        batch = ProposalInput([st.req_id for st in states], [st.token_ids for st in states], taken,
                              sampling_params=[st.sampling_params for st in states],
                              target_token_ids=[step.verified.get(k, out.sampled_token_ids[p])
                                                for k, p in enumerate(step.sample_positions)], step_s=step_s,
                              resumed=self._unproposed)
        self._unproposed = False
        if self._hidden is not None:  # the row whose logits gave each request's newest token
            rows, first = [], 0
            for k, n in enumerate(taken):
                rows.append(first + max(n, 1) - 1)
                first += 1 + len(step.sample_drafts.get(k, ()))
            batch.hidden_states = self._hidden.index_select(0, torch.tensor(rows, device=self._hidden.device))
            self._hidden = None
        return self.proposer.propose(batch)

    def _prompt_logprobs(self, hidden: torch.Tensor, st: CachedRequestState, pos0: int) -> list[LogprobEntry]:
        logprobs = self.model.compute_logits(hidden).float().log_softmax(dim=-1)
        targets = torch.tensor(st.token_ids[pos0:pos0 + hidden.shape[0]], device=self.device)
        return topn_logprobs(logprobs, targets, st.sampling_params.prompt_logprobs or 0)


@dataclass
class _TokensBehind:
    """A step's sampled rows whose tokens an earlier pipeline stage has not taken yet."""

    req_ids: set[str]
    states: list[CachedRequestState]
    capacity: list[int]  # the most tokens each row takes


def draft_probs_of(req_ids: list[str], drafts: dict[int, list[int]], q: dict[str, torch.Tensor]
                   ) -> dict[int, torch.Tensor]:
    """The proposer's draft distributions for the drafts the step verifies (a prefix of those proposed)."""
    out = {}
    for k, d in drafts.items():
        probs = q.get(req_ids[k])
        if probs is not None and probs.shape[0] >= len(d):
            out[k] = probs[:len(d)]
    return out


def _without(so: SchedulerOutput, failed: dict[str, str]) -> SchedulerOutput:
    """The step without these requests (their tokens are not computed)."""
    tokens = {rid: n for rid, n in so.num_scheduled_tokens.items() if rid not in failed}
    spec = {rid: d for rid, d in so.scheduled_spec_decode_tokens.items() if rid not in failed}
    return dataclasses.replace(so, num_scheduled_tokens=tokens, total_num_scheduled_tokens=sum(tokens.values()),
                               scheduled_spec_decode_tokens=spec)
