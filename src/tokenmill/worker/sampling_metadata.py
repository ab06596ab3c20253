"""The sampling parameters of the requests a worker holds, kept across steps, and each step's view.

SamplingTable holds one row per request in preallocated arrays (temperature, top-k/p, min-p, the
greedy, seeded, processor and logprobs needs), written when a request is added and condensed when
one finishes (the last row moves into the hole), with batch-wide counts of the needs beside them.
Each step takes a SamplingMetadata from it: the rows the step samples gathered by index, and flags
from the counts, so no step rebuilds a request's parameters in Python. A request with k draft
tokens samples 1 + k rows, consecutive: its last token's position, then each draft's.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from tokenmill.attention.backend import to_device
from tokenmill.core.structured_output import GrammarBitmasks
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.rejection_sampler import accepted_run


@dataclass
class SamplingRow:
    """One sampled sequence. token_ids is the request's own list (prompt then outputs), shared,
    not copied: only penalties and min_tokens look at it, so most steps never slice it."""

    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    eos_token_ids: tuple[int, ...]
    generator: torch.Generator | None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def plain_greedy_from(params: SamplingParams, num_prompt_tokens: int) -> float:
    """The sequence length (prompt + outputs) from which sampling is plain greedy: greedy with
    nothing that changes or reports the logits, once min_tokens is reached; inf if never."""
    p = params
    if p.greedy and p.logprobs is None and not p.logit_bias and not p.needs_penalties and not p.bad_words_token_ids:
        return num_prompt_tokens + p.min_tokens
    return math.inf


def is_plain_greedy(row: SamplingRow) -> bool:
    return len(row.token_ids) >= plain_greedy_from(row.params, row.num_prompt_tokens)


@dataclass
class SamplingMetadata:
    """The rows one step samples, in logits order, and what sampling them needs."""

    temperature: torch.Tensor  # [R] float32, 1 where greedy
    top_k: torch.Tensor  # [R] int64, 0 = off
    top_p: torch.Tensor  # [R] float32
    min_p: torch.Tensor  # [R] float32
    greedy: torch.Tensor  # [R] bool
    all_greedy: bool
    any_filter: bool  # some row asks for top-k, top-p or min-p
    never_plain: bool  # some row is not plain greedy at any length
    pending_plain: list[SamplingRow]  # rows plain greedy once they reach min_tokens
    generators: list[tuple[int, torch.Generator]]  # (row, generator) of seeded requests without drafts
    seeded_groups: list[tuple[int, torch.Generator, list[int]]]  # (first row, generator, drafts) with drafts
    processors: list[tuple[int, SamplingRow]]  # rows whose min_tokens, logit_bias or penalties may apply
    logprobs: list[int] | None  # per row: the top logprobs it reports (-1: none); None where no row asks
    num_requests: int
    drafts: dict[int, list[int]] = field(default_factory=dict)  # request index -> its drafts
    bitmask: torch.Tensor | None = None  # [R, words] int32 (core/structured_output.py); None: unconstrained
    # the bitmasks being filled off the step loop, with the requests' ids in order and the device; the
    # worker takes them (await_bitmask) when it samples, after the forward
    bitmask_pending: tuple[Future[dict[str, np.ndarray]], Sequence[str], torch.device | None] | None = None
    _write_errors: list[BaseException] = field(default_factory=list)  # bitmask_written's
    # request index -> [drafts, vocab]: the distributions its drafts were sampled from (draft_model)
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @property
    def all_plain_greedy(self) -> bool:
        """Whether argmax alone gives every row's token (checked when the step runs: min_tokens
        counts the tokens taken since the step was built)."""
        return self.bitmask is None and self.bitmask_pending is None and self.all_argmax

    @property
    def bitmask_ready(self) -> bool:
        """Whether await_bitmask would not wait."""
        return self.bitmask_pending is None or self.bitmask_pending[0].done()

    def await_bitmask(self) -> None:
        """Wait for bitmasks filled off the step loop and set `bitmask` from them."""
        if self.bitmask_pending is not None:
            future, req_ids, device = self.bitmask_pending
            self.bitmask_pending = None
            masks = future.result()
            if masks:
                self.bitmask = _assemble_bitmask(self, req_ids, masks, device)

    def bitmask_written(self, words: int, release: Callable[[torch.Tensor], None]) -> tuple[torch.Tensor, torch.Tensor]:
        """For a call that waits for the pending bitmasks itself: an int32 [R, words] that they are written
        into and an int32 [1] flag that `release` sets once they are (on the CPU, by the thread that completes
        their fill; every bit set where it failed). take_written after the call."""
        assert self.bitmask_pending is not None
        future, req_ids, _ = self.bitmask_pending
        rows = torch.empty((self.num_rows, words), dtype=torch.int32)
        ready = torch.zeros(1, dtype=torch.int32)
        errors = self._write_errors

        def write(done: Future[dict[str, np.ndarray]]) -> None:
            with torch.inference_mode():  # (the tensors are the step's, made under it)
                try:
                    masks = done.result()
                    if masks:
                        _bitmask_rows(self, req_ids, masks, rows.numpy())
                    else:
                        rows.fill_(-1)
                except BaseException as e:  # the fill's error, or this one: take_written raises it
                    errors.append(e)
                    rows.fill_(-1)
                finally:
                    release(ready)

        future.add_done_callback(write)
        return rows, ready

    def take_written(self, rows: torch.Tensor) -> None:
        """After the call that waited for bitmask_written's flag: those rows are the bitmask (raises the error
        where filling them failed)."""
        self.bitmask_pending = None
        if self._write_errors:
            raise self._write_errors[0]
        self.bitmask = rows

    @property
    def all_argmax(self) -> bool:
        """Whether each row's token is the argmax over the tokens its bitmask allows (every token where
        there is none): all_plain_greedy, with or without a bitmask."""
        return not self.never_plain and all(is_plain_greedy(r) for r in self.pending_plain)

    @cached_property
    def first_rows(self) -> list[int]:
        """Each request's first row."""
        if not self.drafts:
            return list(range(self.num_requests))
        sizes = [1 + len(self.drafts.get(i, ())) for i in range(self.num_requests)]
        return [0, *np.cumsum(sizes)[:-1].tolist()]

    def runs(self, row_tokens: list[int]) -> list[list[int]]:
        """Per request, the tokens it takes from its rows' sampled tokens: the one, or with drafts
        the accepted run (spec_decode.rejection_sampler)."""
        if not self.drafts:
            return [[t] for t in row_tokens]
        out = []
        for i, first in enumerate(self.first_rows):
            drafts = self.drafts.get(i)
            if drafts is None:
                out.append([row_tokens[first]])
            else:
                out.append(accepted_run(row_tokens[first:first + len(drafts) + 1], drafts))
        return out


GATHERED_KEPT = 16  # SamplingTable's most layouts of gathered tensors kept at once
# a view's per-row temperature, top_k, top_p, min_p and greedy
RowTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class SamplingTable:
    """One row per request the worker holds (see the module docstring)."""

    ARRAYS = ("temperature", "top_k", "top_p", "min_p", "greedy", "filter", "seeded", "never_plain",
              "pending_plain", "processors", "logprobs")

    def __init__(self, eos_token_ids: tuple[int, ...] = (), capacity: int = 64) -> None:
        self.eos_token_ids = eos_token_ids
        self.index: dict[str, int] = {}
        self.req_ids: list[str] = []
        self.rows: list[SamplingRow] = []
        self.temperature = np.ones(capacity, np.float32)
        self.top_k = np.zeros(capacity, np.int64)
        self.top_p = np.ones(capacity, np.float32)
        self.min_p = np.zeros(capacity, np.float32)
        self.greedy = np.zeros(capacity, np.bool_)
        self.filter = np.zeros(capacity, np.bool_)
        self.seeded = np.zeros(capacity, np.bool_)
        self.never_plain = np.zeros(capacity, np.bool_)
        self.pending_plain = np.zeros(capacity, np.bool_)
        self.processors = np.zeros(capacity, np.bool_)
        self.logprobs = np.full(capacity, -1, np.int32)
        # batch-wide counts of the rows with each need
        self.num_random = self.num_filter = self.num_seeded = self.num_never_plain = self.num_processors = 0
        self._pending: dict[str, SamplingRow] = {}  # rows with min_tokens to reach before they are plain
        # view's per-row tensors (temperature, top_k, top_p, min_p, greedy) by (device, row indices), as long as no
        # request is added or removed: the steps of a batch whose requests stay the same gather them once per
        # layout of drafts. Their readers only read them.
        self._gathered: dict[tuple[str, bytes], RowTensors] = {}
        self._logprobs = Counter[int]()  # logprobs asked -> rows asking

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, req_id: str, row: SamplingRow) -> None:
        """Add a request's row; if a value does not fit its array (e.g. a top_k past int64), nothing
        is added and the error propagates."""
        i = len(self.rows)
        if i == len(self.temperature):
            self._grow()
        p = row.params
        self.temperature[i] = p.temperature or 1.0
        self.top_k[i], self.top_p[i], self.min_p[i] = p.top_k, p.top_p, p.min_p
        self.greedy[i] = p.greedy
        self.filter[i] = p.top_k > 0 or p.top_p < 1 or p.min_p > 0
        self.seeded[i] = row.generator is not None
        plain_from = plain_greedy_from(p, row.num_prompt_tokens)
        self.never_plain[i] = plain_from == math.inf
        self.pending_plain[i] = len(row.token_ids) < plain_from < math.inf
        self.processors[i] = (p.min_tokens > 0 or bool(p.logit_bias) or p.needs_penalties
                              or bool(p.bad_words_token_ids))
        self.logprobs[i] = -1 if p.logprobs is None else p.logprobs
        self.index[req_id] = i
        self.req_ids.append(req_id)
        self.rows.append(row)
        self._gathered.clear()
        if self.pending_plain[i]:
            self._pending[req_id] = row
        self._count(i, 1)

    def remove(self, req_id: str) -> None:
        i = self.index.pop(req_id, None)
        if i is None:
            return
        self._count(i, -1)
        self._pending.pop(req_id, None)
        self._gathered.clear()
        last = len(self.rows) - 1
        if i != last:  # condense: the last row fills the hole
            moved = self.req_ids[last]
            self.index[moved] = i
            self.req_ids[i], self.rows[i] = moved, self.rows[last]
            for name in self.ARRAYS:
                a = getattr(self, name)
                a[i] = a[last]
        self.req_ids.pop()
        self.rows.pop()

    def view(self, req_ids: Sequence[str], drafts: dict[int, list[int]] | None = None,
             bitmasks: GrammarBitmasks | None = None, device: torch.device | None = None) -> SamplingMetadata:
        """The rows of these requests (in this order; request i with drafts[i] takes 1 + k rows), with
        the token bitmasks of those constrained (or the Future of them, for await_bitmask)."""
        self._refresh_pending()
        idx = np.fromiter(map(self.index.__getitem__, req_ids), np.int64, len(req_ids))
        rows = idx
        if drafts:
            sizes = np.ones(len(idx), np.int64)
            sizes[list(drafts)] += [len(d) for d in drafts.values()]
            rows = np.repeat(idx, sizes)

        target = device or torch.device("cpu")
        key = (str(target), rows.tobytes())
        tensors = self._gathered.get(key)
        if tensors is None:  # (to a GPU without waiting for the step in flight)
            t, k, p, m, g = (to_device(torch.from_numpy(a[rows]), target)
                             for a in (self.temperature, self.top_k, self.top_p, self.min_p, self.greedy))
            tensors = (t, k, p, m, g)
            if len(self._gathered) >= GATHERED_KEPT:
                self._gathered.clear()
            self._gathered[key] = tensors
        lp = self.logprobs[rows] if self._logprobs else None
        meta = SamplingMetadata(
            *tensors, self.num_random == 0 or bool(self.greedy[idx].all()),
            self.num_filter > 0 and bool(self.filter[idx].any()),
            self.num_never_plain > 0 and bool(self.never_plain[idx].any()),
            [self.rows[i] for i in idx[self.pending_plain[idx]]] if self._pending else [],
            [], [], [], None if lp is None or not (lp >= 0).any() else lp.tolist(), len(idx), dict(drafts or {}))
        self._per_request(meta, idx)
        if isinstance(bitmasks, Future):
            meta.bitmask_pending = (bitmasks, req_ids, device)
        elif bitmasks:
            meta.bitmask = _assemble_bitmask(meta, req_ids, bitmasks, device)
        return meta

    def _per_request(self, meta: SamplingMetadata, idx: np.ndarray) -> None:
        """The lists that name rows: seeded generators and processor rows (few requests have either)."""
        first = meta.first_rows if meta.drafts and (self.num_seeded or self.num_processors) else None
        for k in (np.flatnonzero(self.seeded[idx]).tolist() if self.num_seeded else ()):
            gen, row = self.rows[idx[k]].generator, first[k] if first else k
            assert gen is not None
            if k in meta.drafts:
                meta.seeded_groups.append((row, gen, meta.drafts[k]))
            else:
                meta.generators.append((row, gen))
        for k in (np.flatnonzero(self.processors[idx]).tolist() if self.num_processors else ()):
            base, row = self.rows[idx[k]], first[k] if first else k
            meta.processors.append((row, base))
            for j, _ in enumerate(meta.drafts.get(k, ())):  # each draft's row: as if those before it were taken
                taken = base.token_ids + meta.drafts[k][:j + 1]
                meta.processors.append((row + j + 1, SamplingRow(base.params, taken, base.num_prompt_tokens,
                                                                 base.eos_token_ids, None)))

    def _refresh_pending(self) -> None:
        for req_id, row in list(self._pending.items()):
            if is_plain_greedy(row):
                del self._pending[req_id]
                self.pending_plain[self.index[req_id]] = False

    def _count(self, i: int, sign: int) -> None:
        self.num_random += sign * int(not self.greedy[i])
        self.num_filter += sign * int(self.filter[i])
        self.num_seeded += sign * int(self.seeded[i])
        self.num_never_plain += sign * int(self.never_plain[i])
        self.num_processors += sign * int(self.processors[i])
        if self.logprobs[i] >= 0:
            self._logprobs[int(self.logprobs[i])] += sign
            self._logprobs += Counter()  # drops the counts that reached 0

    def _grow(self) -> None:
        for name in self.ARRAYS:
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.empty_like(a)]))

    @property
    def max_logprobs(self) -> int | None:
        return max(self._logprobs) if self._logprobs else None


def _assemble_bitmask(meta: SamplingMetadata, req_ids: Sequence[str], bitmasks: dict[str, np.ndarray],
                      device: torch.device | None) -> torch.Tensor:
    """[R, words] int32: each constrained request's rows from its bitmask, every bit set elsewhere."""
    words = next(iter(bitmasks.values())).shape[-1]
    return torch.from_numpy(_bitmask_rows(meta, req_ids, bitmasks, np.empty((meta.num_rows, words), np.int32))
                            ).to(device or "cpu")


def _bitmask_rows(meta: SamplingMetadata, req_ids: Sequence[str], bitmasks: dict[str, np.ndarray],
                  out: np.ndarray) -> np.ndarray:
    """_assemble_bitmask's rows, written into out ([R, words] int32)."""
    if len(bitmasks) == len(req_ids):  # every request constrained: their rows, in order
        return np.concatenate([bitmasks[rid] for rid in req_ids], out=out)
    out.fill(-1)
    first = meta.first_rows
    position = {rid: k for k, rid in enumerate(req_ids)}
    for rid, mask in bitmasks.items():
        row = first[position[rid]]
        out[row:row + mask.shape[0]] = mask
    return out


def metadata_for(rows: Sequence[SamplingRow], drafts: dict[int, list[int]] | None = None,
                 bitmasks: dict[int, np.ndarray] | None = None) -> SamplingMetadata:
    """A step's metadata for these rows, one request each (request i with drafts[i] and the token
    bitmask bitmasks[i]), through a table of their own: for tests and one-off callers."""
    table = SamplingTable()
    for i, row in enumerate(rows):
        table.add(str(i), row)
    masks = {str(i): m for i, m in (bitmasks or {}).items()}
    return table.view([str(i) for i in range(len(rows))], drafts, masks)
