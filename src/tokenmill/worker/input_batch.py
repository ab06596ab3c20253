"""Worker-side state of the requests it holds, and the flat per-step batch built from a
SchedulerOutput (decodes first, then prefill chunks and requests with draft tokens)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.core.sched_output import SchedulerOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.sampling_metadata import SamplingRow, SamplingTable


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class StepBatch:
    req_ids: list[str]  # in batch order
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    num_decodes: int
    sample_states: list[CachedRequestState]  # requests whose chunk reaches their last token
    logits_indices: list[int]  # flat-batch rows whose logits are sampled (1 + drafts per request, in order)
    logits_seqs: list[int]  # the place in req_ids of each of those rows
    sample_positions: list[int]  # the sampling requests' places in req_ids (same order as sample_states)
    # rid -> (row0, n, pos0, state): rows whose logits score prompt tokens
    prompt_lp_rows: dict[str, tuple[int, int, int, CachedRequestState]] = field(default_factory=dict)
    # decode rows whose input is the token the step before samples (async scheduling: not known when
    # the step is built): (row, state, position); fill_pending_inputs sets them once that step is done
    pending_inputs: list[tuple[int, CachedRequestState, int]] = field(default_factory=list)
    # index into sample_states -> the draft tokens it verifies this step (its rows follow its last token's)
    sample_drafts: dict[int, list[int]] = field(default_factory=dict)
    # index into sample_states -> the token sampled at each of its rows (1 + drafts), where it had drafts
    verified: dict[int, list[int]] = field(default_factory=dict)

    @property
    def sample_req_ids(self) -> list[str]:
        return [self.req_ids[p] for p in self.sample_positions]

    def fill_pending_inputs(self) -> None:
        for row, st, pos in self.pending_inputs:
            # a request whose step failed took no token; it is ended, and its row's output is dropped
            self.input_ids[row] = st.token_ids[pos] if pos < len(st.token_ids) else 0


def update_states(states: dict[str, CachedRequestState], so: SchedulerOutput, device: torch.device,
                  sampling: SamplingTable, failed: dict[str, str]) -> None:
    """Apply the scheduler's changes. A new request whose state cannot be built (its sampling
    parameters break the table, a seed the generator refuses) is recorded in `failed` instead, and
    left out of this and every later step until the scheduler reports it finished."""
    for rid in so.finished_req_ids:
        states.pop(rid, None)
        sampling.remove(rid)
        failed.pop(rid, None)
    for new in so.scheduled_new_reqs:
        try:
            gen = None
            if new.sampling_params.seed is not None:
                gen = torch.Generator(device=device)
                gen.manual_seed(new.sampling_params.seed)
            st = CachedRequestState(new.req_id, [*new.prompt_token_ids, *new.output_token_ids],
                                    len(new.prompt_token_ids), new.sampling_params, list(new.block_ids),
                                    new.num_computed_tokens)
            sampling.add(new.req_id, SamplingRow(new.sampling_params, st.token_ids, st.num_prompt_tokens,
                                                 sampling.eos_token_ids, gen))
            states[new.req_id] = st
        except Exception as e:  # this request's data, not the engine: it alone ends
            failed[new.req_id] = f"the request could not be prepared: {type(e).__name__}: {e}"
    for cached in so.scheduled_cached_reqs:
        held = states.get(cached.req_id)
        if held is None:  # failed when it was new
            continue
        if cached.resumed_from_preemption:
            held.block_ids = list(cached.new_block_ids)
        else:
            held.block_ids.extend(cached.new_block_ids)
        held.num_computed_tokens = cached.num_computed_tokens


def build_step(states: dict[str, CachedRequestState], so: SchedulerOutput, block_size: int) -> StepBatch:
    order = sorted(so.num_scheduled_tokens, key=lambda r: so.num_scheduled_tokens[r] != 1)
    num_decodes = sum(1 for r in order if so.num_scheduled_tokens[r] == 1)
    # decodes (one token each) in plain Python ints, which is cheaper than numpy per row;
    # prefill chunks as numpy ranges
    ids: list[np.ndarray] = [np.empty(num_decodes, dtype=np.int64)]
    pos: list[np.ndarray] = [np.empty(num_decodes, dtype=np.int64)]
    slots: list[np.ndarray] = [np.empty(num_decodes, dtype=np.int64)]
    dec_ids, dec_pos, dec_slots = [], [], []
    qsl = [0]
    seq_lens, tables, sample_pos = [], [], []
    logits_idx: list[int] = []
    logits_seqs: list[int] = []
    sample_states: list[CachedRequestState] = []
    prompt_rows: dict[str, tuple[int, int, int, CachedRequestState]] = {}
    pending: list[tuple[int, CachedRequestState, int]] = []
    spec = so.scheduled_spec_decode_tokens
    sample_drafts: dict[int, list[int]] = {}
    for i, rid in enumerate(order):
        st = states[rid]  # (requests without a state are left out of `so` by the runner)
        n = so.num_scheduled_tokens[rid]
        start = st.num_computed_tokens
        drafts: Sequence[int] = spec.get(rid, ()) if spec else ()  # inputs after the request's own tokens
        if n == 1:
            if start < len(st.token_ids):
                dec_ids.append(st.token_ids[start])
            else:  # being sampled by the step in flight
                dec_ids.append(0)
                pending.append((i, st, start))
            dec_pos.append(start)
            dec_slots.append(st.block_ids[start // block_size] * block_size + start % block_size)
        else:
            p = np.arange(start, start + n)
            first = start // block_size  # only the blocks this chunk writes, not the whole table
            blocks = np.asarray(st.block_ids[first:(start + n - 1) // block_size + 1])
            ids.append(np.asarray(st.token_ids[start:start + n - len(drafts)] + list(drafts)))
            pos.append(p)
            slots.append(blocks[p // block_size - first] * block_size + p % block_size)
        row0 = qsl[-1]
        qsl.append(row0 + n)
        seq_lens.append(start + n)
        tables.append(st.block_ids)  # the next step may extend it while this one runs: the head stays
        if start + n - len(drafts) >= len(st.token_ids):
            if drafts:  # the last token's row, then each draft's
                sample_drafts[len(sample_states)] = list(drafts)
                logits_idx.extend(range(row0 + n - 1 - len(drafts), row0 + n - 1))
                logits_seqs.extend([i] * len(drafts))
            logits_idx.append(row0 + n - 1)
            logits_seqs.append(i)
            sample_pos.append(i)
            sample_states.append(st)
        if st.sampling_params.prompt_logprobs is not None and start < st.num_prompt_tokens - 1:
            # position p's logits score prompt token p + 1
            count = min(start + n, st.num_prompt_tokens - 1) - start
            prompt_rows[rid] = (row0, count, start + 1, st)
    ids[0][:], pos[0][:], slots[0][:] = dec_ids, dec_pos, dec_slots
    return StepBatch(order, np.concatenate(ids), np.concatenate(pos), np.concatenate(slots), qsl,
                     seq_lens, tables, num_decodes, sample_states, logits_idx, logits_seqs, sample_pos,
                     prompt_rows, pending, sample_drafts)
