"""Turns a SchedulerOutput into tensors, runs the model over the paged KV cache, samples."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, cast

import torch

from tokenmill.attention import get_backend
from tokenmill.attention.backend import AttentionMetadata, OutputRows, output_rows
from tokenmill.config import EngineConfig, default_num_threads
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.kernels import load_cpu_kernels
from tokenmill.layers.linear import pack_linears
from tokenmill.models.loader import TORCH_DTYPES, load_model
from tokenmill.worker.input_batch import CachedRequestState, StepBatch, build_step, update_states
from tokenmill.worker.memory import BackgroundPopulate, keep_freed_memory, zeros_lazily
from tokenmill.worker.sampler import LogprobEntry, Sampler, SamplerOutput, SamplingRow, topn_logprobs

logger = logging.getLogger(__name__)


@dataclass
class PreparedStep:
    step: StepBatch
    meta: AttentionMetadata
    rows: OutputRows | None  # the rows whose outputs are used, where that is fewer than all


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
        self.sampler = Sampler(ops)
        # only the sampled rows through the last layer's attention output and MLP (OutputRows);
        # False runs every row through it, the reference path the tests compare with
        self.output_rows_only = True
        self.eos_token_ids = self.arch.eos_token_ids
        logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB)", self.num_blocks,
                    self.block_size, self.num_blocks * self.block_size, self.kv_cache.numel()
                    * self.kv_cache.element_size() / 2**20)

    def _num_blocks(self) -> int:
        if self.config.cache.num_kv_blocks is not None:
            return self.config.cache.num_kv_blocks
        per_block = self.block_size * self.arch.kv_bytes_per_token * torch.finfo(self.dtype).bits // 8
        return max(1, self.config.cache.kv_cache_bytes // per_block)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute(self.prepare(so))

    def prepare(self, so: SchedulerOutput) -> PreparedStep | None:
        """The step's inputs, built from the states as they are now: for async scheduling this runs while
        the step before is still executing, so a decode row whose token that step samples is left
        pending (StepBatch.pending_inputs) and filled in by execute(). None: nothing to run."""
        update_states(self.states, so, self.device)
        if so.total_num_scheduled_tokens == 0:
            return None
        step = build_step(self.states, so, self.block_size)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(step.slot_mapping).to(self.device),
            query_start_loc=step.query_start_loc, seq_lens=step.seq_lens, block_tables=step.block_tables,
            num_decodes=step.num_decodes, block_size=self.block_size, sliding_window=self.arch.sliding_window)
        self.backend.prepare(meta, self.device)
        rows = None
        if self.output_rows_only and not step.prompt_lp_rows and len(step.logits_indices) < len(step.input_ids):
            # only the sampled rows need the last layer's output (prompt logprobs need every row's)
            rows = output_rows(meta, step.logits_indices, step.sample_positions)
            self.backend.prepare(rows.meta, self.device)
        return PreparedStep(step, meta, rows)

    def execute(self, prepared: PreparedStep | None) -> ModelRunnerOutput:
        """Run a prepared step; steps must execute in the order they were prepared."""
        if prepared is None:
            return ModelRunnerOutput([], [])
        with self._populate.paused():
            return self._execute(prepared.step, prepared.meta, prepared.rows)

    @torch.inference_mode()
    def _execute(self, step: StepBatch, meta: AttentionMetadata, rows: OutputRows | None) -> ModelRunnerOutput:
        step.fill_pending_inputs()
        input_ids = torch.from_numpy(step.input_ids).to(self.device)
        positions = torch.from_numpy(step.positions).to(self.device)
        out = ModelRunnerOutput(step.req_ids, [[] for _ in step.req_ids])
        states = step.sample_states
        # the common case, every row plain greedy, skips building the sampler's rows
        greedy = all(len(st.token_ids) >= st.greedy_from for st in states)
        if greedy and states and len(states) == len(step.input_ids) and not step.prompt_lp_rows:
            ids = self.model.decode_greedy(input_ids, positions, self.kv_caches, meta)
            if ids is not None:  # the whole step in one call, to its tokens
                self._record(step, out, SamplerOutput(ids.tolist()))
                return out
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend, rows)
        if states:
            self._sample(hidden, step, out, greedy)
        for rid, (row0, n, pos0, st) in step.prompt_lp_rows.items():
            out.prompt_logprobs[rid] = (pos0, self._prompt_logprobs(hidden[row0:row0 + n], st, pos0))
        return out

    def _sample(self, hidden: torch.Tensor, step: StepBatch, out: ModelRunnerOutput, greedy: bool) -> None:
        if len(step.logits_indices) < hidden.shape[0]:  # the model gave every row's
            hidden = hidden.index_select(0, torch.tensor(step.logits_indices, device=self.device))
        logits = self.model.compute_logits(hidden)  # all rows (a pure-decode step): in order, as they are
        states = step.sample_states
        ids = self.sampler.argmax(logits) if greedy else None
        if ids is not None:
            sampled = SamplerOutput(ids)
        else:
            sampled = self.sampler(logits, [SamplingRow(st.sampling_params, st.token_ids, st.num_prompt_tokens,
                                                        self.eos_token_ids, st.generator) for st in states])
        self._record(step, out, sampled)

    @staticmethod
    def _record(step: StepBatch, out: ModelRunnerOutput, sampled: SamplerOutput) -> None:
        """Each sampled row's token (and logprobs) into its request's state and the step's output."""
        rows = zip(step.sample_states, step.sample_positions, sampled.token_ids, strict=False)
        for k, (st, pos, tok) in enumerate(rows):
            st.token_ids.append(tok)
            out.sampled_token_ids[pos] = [tok]
            if sampled.logprobs and sampled.logprobs[k] is not None:
                out.logprobs[st.req_id] = [sampled.logprobs[k]]  # type: ignore[list-item]

    def _prompt_logprobs(self, hidden: torch.Tensor, st: CachedRequestState, pos0: int) -> list[LogprobEntry]:
        logprobs = self.model.compute_logits(hidden).float().log_softmax(dim=-1)
        targets = torch.tensor(st.token_ids[pos0:pos0 + hidden.shape[0]], device=self.device)
        return topn_logprobs(logprobs, targets, st.sampling_params.prompt_logprobs or 0)
