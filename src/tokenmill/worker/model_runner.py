"""Turns a SchedulerOutput into tensors, runs the model over the paged KV cache, samples."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, cast

import torch

from tokenmill.attention import get_backend
from tokenmill.attention.backend import AttentionMetadata, OutputRows, output_rows
from tokenmill.attention.cpu_kernels import load_cpu_kernels
from tokenmill.config import EngineConfig, default_num_threads
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.layers.linear import pack_linears
from tokenmill.models.loader import TORCH_DTYPES, load_model
from tokenmill.spec_decode.proposer import ProposalInput, Proposer
from tokenmill.worker.input_batch import CachedRequestState, StepBatch, build_step, update_states
from tokenmill.worker.memory import BackgroundPopulate, keep_freed_memory, zeros_lazily
from tokenmill.worker.sampler import Sampler, SamplerOutput, topn_logprobs
from tokenmill.worker.sampling_metadata import LogprobEntry, SamplingMetadata, SamplingTable

logger = logging.getLogger(__name__)


@dataclass
class PreparedStep:
    step: StepBatch
    meta: AttentionMetadata
    rows: OutputRows | None  # the rows whose outputs are used, where that is fewer than all
    sampling: SamplingMetadata | None  # the sampled rows' parameters; None: the step samples nothing


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.device.num_threads or default_num_threads())
            keep_freed_memory()
        torch.manual_seed(config.model.seed)
        self.dtype = TORCH_DTYPES[config.model.dtype]
        self.arch = config.model.arch
        self.model: Any = cast(Any, load_model(config.model.model, self.arch, self.dtype, self.device))
        ops = None
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            ops = load_cpu_kernels() if config.device.cpu_kernels else None
            pack_linears(self.model, ops)
            if ops is not None:
                self.model.enable_fused_ops(ops)
        self.backend = get_backend(config.attention_backend)
        self.block_size = config.cache.block_size
        self.num_blocks = self._num_blocks()
        shape = (self.arch.num_layers, 2, self.num_blocks, self.block_size, self.arch.num_kv_heads,
                 self.arch.head_dim)
        self.kv_cache = zeros_lazily(shape, self.dtype, self.device)
        self.kv_caches = list(self.kv_cache.unbind(0))
        self._populate = BackgroundPopulate(self.kv_cache, block_dim=2)  # begins after the first step
        self.states: dict[str, CachedRequestState] = {}
        self.eos_token_ids = self.arch.eos_token_ids
        self.sampling = SamplingTable(self.eos_token_ids)  # the states' sampling parameters, one row each
        self.sampler = Sampler(ops)
        self.proposer: Proposer | None = None  # draft tokens for the next step (speculative decoding)
        # only the sampled rows through the last layer's attention output and MLP (OutputRows);
        # False runs every row through it, the reference path the tests compare with
        self.output_rows_only = True
        logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB)", self.num_blocks,
                    self.block_size, self.num_blocks * self.block_size, self.kv_cache.numel()
                    * self.kv_cache.element_size() / 2**20)

    def _num_blocks(self) -> int:
        if self.config.cache.num_kv_blocks is not None:
            return self.config.cache.num_kv_blocks
        per_block = self.block_size * self.arch.kv_bytes_per_token * torch.finfo(self.dtype).bits // 8
        return max(1, self.config.cache.kv_cache_bytes // per_block)

    def set_proposer(self, proposer: Proposer | None) -> None:
        # a request's drafts follow the tokens the step before took, so that step's output must be in
        # before the next step is scheduled: async scheduling schedules it first
        if proposer is not None and self.config.scheduler.async_scheduling:
            raise ValueError("speculative decoding needs async_scheduling off")
        self.proposer = proposer

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute(self.prepare(so))

    def prepare(self, so: SchedulerOutput) -> PreparedStep | None:
        """The step's inputs, built from the states as they are now: for async scheduling this runs while
        the step before is still executing, so a decode row whose token that step samples is left
        pending (StepBatch.pending_inputs) and filled in by execute(). None: nothing to run."""
        update_states(self.states, so, self.device, self.sampling)
        if so.total_num_scheduled_tokens == 0:
            return None
        step = build_step(self.states, so, self.block_size)
        sampling = None
        if step.sample_states:  # gathered here: the next step's prepare may change the table while this runs
            sampling = self.sampling.view(step.sample_req_ids, step.sample_drafts, so.grammar_bitmask, self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(step.slot_mapping).to(self.device),
            query_start_loc=step.query_start_loc, seq_lens=step.seq_lens, block_tables=step.block_tables,
            num_decodes=step.num_decodes, block_size=self.block_size, sliding_window=self.arch.sliding_window)
        self.backend.prepare(meta, self.device)
        rows = None
        if self.output_rows_only and not step.prompt_lp_rows and len(step.logits_indices) < len(step.input_ids):
            # only the sampled rows need the last layer's output (prompt logprobs need every row's)
            rows = output_rows(meta, step.logits_indices, step.logits_seqs)
            self.backend.prepare(rows.meta, self.device)
        return PreparedStep(step, meta, rows, sampling)

    def execute(self, prepared: PreparedStep | None) -> ModelRunnerOutput:
        """Run a prepared step; steps must execute in the order they were prepared."""
        if prepared is None:
            return ModelRunnerOutput([], [])
        with self._populate.paused():
            out = self._execute(prepared.step, prepared.meta, prepared.rows, prepared.sampling)
            if self.proposer is not None and prepared.step.sample_states:
                out.spec_token_ids = self._propose(prepared.step, out)
        return out

    @torch.inference_mode()
    def _execute(self, step: StepBatch, meta: AttentionMetadata, rows: OutputRows | None,
                 sampling: SamplingMetadata | None) -> ModelRunnerOutput:
        step.fill_pending_inputs()
        input_ids = torch.from_numpy(step.input_ids).to(self.device)
        positions = torch.from_numpy(step.positions).to(self.device)
        out = ModelRunnerOutput(step.req_ids, [[] for _ in step.req_ids])
        states = step.sample_states
        greedy = sampling is not None and sampling.all_plain_greedy  # (and then no bitmask)
        if greedy and len(states) == len(step.input_ids) and not step.prompt_lp_rows:
            ids = self.model.decode_greedy(input_ids, positions, self.kv_caches, meta)
            if ids is not None:  # the whole step in one call, to its tokens
                self._record(step, out, SamplerOutput([[t] for t in ids.tolist()]))
                return out
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend, rows)
        if sampling is not None:
            self._sample(hidden, step, out, sampling, greedy)
        for rid, (row0, n, pos0, st) in step.prompt_lp_rows.items():
            out.prompt_logprobs[rid] = (pos0, self._prompt_logprobs(hidden[row0:row0 + n], st, pos0))
        return out

    def _sample(self, hidden: torch.Tensor, step: StepBatch, out: ModelRunnerOutput, sampling: SamplingMetadata,
                greedy: bool) -> None:
        if len(step.logits_indices) < hidden.shape[0]:  # the model gave every row's
            hidden = hidden.index_select(0, torch.tensor(step.logits_indices, device=self.device))
        logits = self.model.compute_logits(hidden)  # all rows (a pure-decode step): in order, as they are
        ids = self.sampler.argmax(logits) if greedy else None
        sampled = SamplerOutput(sampling.runs(ids)) if ids is not None else self.sampler(logits, sampling)
        self._record(step, out, sampled)

    @staticmethod
    def _record(step: StepBatch, out: ModelRunnerOutput, sampled: SamplerOutput) -> None:
        """Each sampling request's tokens (and logprobs) into its state and the step's output."""
        rows = zip(step.sample_states, step.sample_positions, sampled.token_ids, strict=False)
        for k, (st, pos, tokens) in enumerate(rows):
            st.token_ids.extend(tokens)
            out.sampled_token_ids[pos] = tokens
            if sampled.logprobs and (logprobs := sampled.logprobs[k]) is not None:
                out.logprobs[st.req_id] = logprobs

    def _propose(self, step: StepBatch, out: ModelRunnerOutput) -> dict[str, list[int]]:
        assert self.proposer is not None
        states = step.sample_states
        taken = [len(out.sampled_token_ids[p]) for p in step.sample_positions]
        return self.proposer.propose(ProposalInput([st.req_id for st in states], [st.token_ids for st in states],
                                                   taken))

    def _prompt_logprobs(self, hidden: torch.Tensor, st: CachedRequestState, pos0: int) -> list[LogprobEntry]:
        logprobs = self.model.compute_logits(hidden).float().log_softmax(dim=-1)
        targets = torch.tensor(st.token_ids[pos0:pos0 + hidden.shape[0]], device=self.device)
        return topn_logprobs(logprobs, targets, st.sampling_params.prompt_logprobs or 0)
