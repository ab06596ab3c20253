"""Batched sampling: the token bitmask (structured output), logit processors (min_tokens,
logit_bias, penalties), greedy argmax, temperature / top-k / top-p / min-p, per-request seeded
generators, raw logprobs, and the verification of draft tokens (spec_decode.rejection_sampler).

Random sampling inverts each row's CDF at one uniform draw, so a seeded request draws exactly
one number from its own generator per token it takes, whatever else runs; a [vocab] vector of noise per
row would cost more than the inversion (bench/README.md, "Measurements behind the code").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from tokenmill.core.messages import LogprobEntry
from tokenmill.core.structured_output import BITS_PER_WORD
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.sampling_metadata import SamplingMetadata, SamplingRow


@dataclass
class SamplerOutput:
    token_ids: list[list[int]]  # per request: the tokens it takes (accepted drafts, then one more)
    logprobs: list[list[LogprobEntry] | None] = field(default_factory=list)  # per request, per token taken
    # with drafts: every row's sampled token (past a rejection too), and each request's first row
    row_token_ids: list[int] = field(default_factory=list)
    first_rows: list[int] = field(default_factory=list)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: -inf for each token whose bit is clear in its row's bitmask ([rows, words] int32,
    token t at bit t % 32 of word t // 32); a token past the mask's words is disallowed too. Only the rows
    with a clear bit are unpacked: a batch's unconstrained rows (every bit set) are left as they are."""
    vocab = logits.shape[-1]
    if vocab <= bitmask.shape[1] * BITS_PER_WORD:  # a row with every bit set (unconstrained) changes nothing
        rows = (bitmask != -1).any(dim=1).nonzero().flatten()
        if rows.numel() < bitmask.shape[0]:
            if rows.numel():
                sub = logits[rows.to(logits.device)]
                apply_token_bitmask(sub, bitmask[rows])
                logits[rows.to(logits.device)] = sub
            return
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    logits.masked_fill_(~allowed[:, :vocab].to(logits.device), float("-inf"))


def apply_logit_processors(logits: torch.Tensor, rows: Sequence[SamplingRow],
                           index: Sequence[int] | None = None) -> None:
    """In place, row by row, only for the rows given: rows[k] is logits row index[k] (k by default)."""
    for k, row in enumerate(rows):
        i = k if index is None else index[k]
        p = row.params
        if row.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(row.eos_token_ids))
            if banned:
                logits[i, banned] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            vals = torch.tensor(list(p.logit_bias.values()), device=logits.device, dtype=logits.dtype)
            logits[i].index_add_(0, ids, vals)
        if p.needs_penalties:
            n = row.num_prompt_tokens
            apply_penalties(logits[i], p, row.token_ids[:n], row.token_ids[n:])
        if p.bad_words_token_ids:
            banned = bad_word_bans(p.bad_words_token_ids, row.token_ids[row.num_prompt_tokens:])
            if banned:
                logits[i, banned] = float("-inf")


def bad_word_bans(words: list[list[int]], output: list[int]) -> list[int]:
    """The tokens that would complete a bad word after these output tokens."""
    return [w[-1] for w in words if len(w) == 1 or (len(w) - 1 <= len(output) and output[len(output) - len(w) + 1:]
                                                     == w[:-1])]


def apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> None:
    vocab = logits.shape[0]
    out_counts = torch.bincount(torch.tensor(output, dtype=torch.long, device=logits.device),
                                minlength=vocab)[:vocab] if output else torch.zeros(vocab, device=logits.device)
    if p.repetition_penalty != 1.0:
        seen = out_counts > 0
        if prompt:
            seen[torch.tensor(prompt, device=logits.device)] = True
        penalised = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        logits.copy_(torch.where(seen, penalised, logits))
    if p.frequency_penalty:
        logits -= p.frequency_penalty * out_counts.to(logits.dtype)
    if p.presence_penalty:
        logits -= p.presence_penalty * (out_counts > 0).to(logits.dtype)


# top-k / top-p / min-p take the top candidates per row by topk, this many and then (for rows that
# need more) this many, and sort no further where they provably hold every token that survives; the
# rows left sort their whole vocabulary, which costs far more than a topk of 256
FILTER_CANDIDATES = (256, 2048)


def drop_by_mass(probs: torch.Tensor, drop: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> None:
    """Over rows of probabilities sorted highest first: add to drop (in place) what top-p and min-p
    exclude; never the first."""
    cum_before = probs.cumsum(dim=-1) - probs
    drop |= cum_before >= top_p[:, None]
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False


def asks_filter(top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, vocab: int) -> torch.Tensor:
    """Rows whose filters exclude anything at all (a top_k of the vocabulary or more excludes nothing)."""
    return ((top_k > 0) & (top_k < vocab)) | (top_p < 1) | (min_p > 0)


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k, nucleus top-p and min-p sets (top-p and
    min-p over the top-k renormalized). top_k 0 = off. The highest-probability token always survives.
    The same sets as filter_logits_sorted, from the top candidates alone where they suffice."""
    vocab, batch = logits.shape[-1], logits.shape[0]
    out: torch.Tensor | None = None  # built only where rows are settled apart
    rows = asks_filter(top_k, top_p, min_p, vocab).nonzero()[:, 0]  # rows still to settle
    for n in FILTER_CANDIDATES:
        if rows.numel() == 0:
            break
        k_rows = top_k[rows]
        k_set = k_rows[(k_rows > 0) & (k_rows < vocab)]
        n = max(n, int(k_set.max()) if k_set.numel() else 0)
        if n >= vocab:
            break
        whole = rows.numel() == batch  # every row: no gathering
        got, covered = filter_top(logits if whole else logits[rows], k_rows, top_p[rows], min_p[rows], n)
        if whole and bool(covered.all()):
            return got  # the common case: one pass settles the batch
        if out is None:
            out = logits.clone()
        done = covered.nonzero()[:, 0]
        out[rows[done]] = got[done]
        rows = rows[~covered]
    if out is None:
        out = logits.clone()
    if rows.numel():
        out[rows] = filter_logits_sorted(logits[rows], top_k[rows], top_p[rows], min_p[rows])
    return out


def filter_top(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
               n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """filter_logits from each row's top n (n at least every row's top_k, below the vocabulary), and
    which rows that settles: every token past the n is dropped too where the row's top k lies within
    them, or they hold top_p of the mass already, or min-p drops the last of them (so all below it)."""
    vocab = logits.shape[-1]
    has_k = (top_k > 0) & (top_k < vocab)
    vals, order = logits.topk(n, dim=-1)  # sorted, highest first
    drop = torch.arange(n, device=logits.device)[None, :] >= torch.where(has_k, top_k, vocab)[:, None]
    masked = vals.masked_fill(drop, float("-inf"))
    # each row's probabilities as the full sort has them: over its top k, or over the whole vocabulary
    lse = torch.where(has_k[:, None], masked.logsumexp(dim=-1, keepdim=True), logits.logsumexp(dim=-1, keepdim=True))
    probs = (masked - lse).exp()
    drop_by_mass(probs, drop, top_p, min_p)
    covered = has_k | (probs.sum(dim=-1) >= top_p) | (probs[:, -1] < min_p * probs[:, 0])
    out = torch.full_like(logits, float("-inf")).scatter_(-1, order, vals.masked_fill(drop, float("-inf")))
    return out, covered


def filter_logits_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                         min_p: torch.Tensor) -> torch.Tensor:
    """filter_logits by sorting each whole row: the reference, and the path where the top
    candidates do not suffice. A row that asks for no filter keeps its logits as they are."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    drop = ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    drop_by_mass(probs, drop, top_p, min_p)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    out = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return torch.where(asks_filter(top_k, top_p, min_p, vocab)[:, None], out, logits)


def topn_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, n: int) -> list[LogprobEntry]:
    """Per row: (ids, logprobs, ranks) with the chosen token first, then the top n."""
    chosen_lp = logprobs.gather(1, chosen[:, None])
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    top_lp, top_ids = logprobs.topk(n, dim=-1) if n else (logprobs[:, :0], chosen[:, None][:, :0])
    out = []
    for c, lp, r, ti, tl in zip(chosen.tolist(), chosen_lp[:, 0].tolist(), ranks.tolist(),
                                top_ids.tolist(), top_lp.tolist(), strict=False):
        out.append(([c, *ti], [lp, *tl], [r, *range(1, len(ti) + 1)]))
    return out


def host_copy(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """(t on the host, the event that marks the copy done). From a GPU the copy goes into pinned memory
    without blocking, behind the work queued before it; the event is None where t is already on the
    host."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host, copied


def host_list(t: torch.Tensor) -> list[int]:
    """A tensor's values as a list. From a GPU: waited for by an event (host_copy), so that only this
    thread waits (the step's worker thread; the core thread schedules the next step meanwhile)."""
    host, copied = host_copy(t)
    if copied is not None:
        copied.synchronize()
    return cast(list[int], host.tolist())


class Sampler:
    def __init__(self, ops: Any = None) -> None:
        self.ops = ops  # tokenmill's C++ CPU kernels: argmax straight from bf16 or float32 logits

    def argmax(self, logits: torch.Tensor, bitmask: torch.Tensor | None = None) -> list[int] | None:
        """Each row's argmax by the C++ kernel (the first of equal maxima, as torch's), over the tokens
        the row's bitmask allows where one is given, or on a GPU by torch's argmax (no bitmask), or None
        where neither applies. For rows that are
        all argmax (SamplingMetadata.all_argmax): the caller checks that."""
        if (self.ops is not None and logits.dtype in (torch.bfloat16, torch.float32)
                and logits.device.type == "cpu"):
            if bitmask is None:
                return self.ops.argmax_rows(logits).tolist()
            return self.ops.argmax_rows_masked(logits, bitmask).tolist()
        if logits.device.type == "cuda" and bitmask is None:  # on the logits as they are, with no float copy
            return host_list(logits.argmax(dim=-1))
        return None

    @staticmethod
    def from_argmax(ids: list[int], meta: SamplingMetadata) -> SamplerOutput:
        """The output of rows that are all argmax (SamplingMetadata.all_argmax), from each row's argmax
        token (over the tokens its bitmask allows, where it has one)."""
        return _with_rows(SamplerOutput(meta.runs(ids)), ids, meta)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if meta.all_argmax and (ids := self.argmax(logits, meta.bitmask)) is not None:
            return self.from_argmax(ids, meta)
        logits = logits.to(torch.float32, copy=True)  # the sampler's own: processors and _choose work in place
        if meta.bitmask is not None:  # before anything else reads the logits
            apply_token_bitmask(logits, meta.bitmask)
        raw_logprobs = logits.log_softmax(dim=-1) if meta.logprobs is not None else None
        if meta.processors:
            apply_logit_processors(logits, [r for _, r in meta.processors], [i for i, _ in meta.processors])
        chosen = self._choose(logits, meta)
        row_ids = host_list(chosen)
        out = _with_rows(SamplerOutput(meta.runs(row_ids)), row_ids, meta)
        if raw_logprobs is not None and meta.logprobs is not None:
            entries = topn_logprobs(raw_logprobs, chosen, max(meta.logprobs))
            for first, run in zip(meta.first_rows, out.token_ids, strict=True):
                n = meta.logprobs[first]
                out.logprobs.append(None if n < 0 else [(ids[: n + 1], lps[: n + 1], rks[: n + 1])
                                                        for ids, lps, rks in entries[first:first + len(run)]])
        return out

    @staticmethod
    def _choose(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Each row's token; logits (float32, the sampler's own) are overwritten."""
        greedy = logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy
        dev = logits.device
        scaled = logits.div_(meta.temperature[:, None])
        if meta.any_filter:
            scaled = filter_logits(scaled, meta.top_k, meta.top_p, meta.min_p)
        # probabilities and their running sums, in float32: each is a full pass over [rows, vocab], and a
        # float64 cumsum is many times slower
        probs = scaled.softmax(dim=-1)
        cdf = probs.cumsum(dim=-1) if meta.draft_probs else probs.cumsum_(dim=-1)
        u = torch.rand(len(cdf), 1, device=dev)
        for i, gen in meta.generators:
            u[i] = torch.rand(1, generator=gen, device=dev)
        chosen = torch.where(meta.greedy, greedy, inverse_cdf(cdf, u, greedy))
        seeded = {first: gen for first, gen, _ in meta.seeded_groups}
        for k, q in meta.draft_probs.items():  # drafts sampled from the proposer's q: min(1, p / q)
            first = meta.first_rows[k]
            if not bool(meta.greedy[first]):
                verify_with_draft_probs(chosen, probs, q, first, meta.drafts[k], seeded.pop(first, None))
        for first, gen, drafts in meta.seeded_groups:
            if first not in seeded:
                continue
            # one uniform per token taken: draw row by row, up to the first row whose token is not its
            # draft (where rejection_sampler.accepted_run ends the run)
            for j in range(len(drafts) + 1):
                r = slice(first + j, first + j + 1)
                u_j = torch.rand(1, 1, generator=gen, device=dev)
                if not bool(meta.greedy[r]):
                    chosen[r] = inverse_cdf(cdf[r], u_j, greedy[r])
                if j == len(drafts) or int(chosen[r]) != drafts[j]:
                    break
        return chosen


def _with_rows(out: SamplerOutput, row_ids: list[int], meta: SamplingMetadata) -> SamplerOutput:
    if meta.drafts:
        out.row_token_ids, out.first_rows = row_ids, meta.first_rows
    return out


def verify_with_draft_probs(chosen: torch.Tensor, probs: torch.Tensor, q: torch.Tensor, first: int,
                            drafts: list[int], gen: torch.Generator | None) -> None:
    """Speculative sampling for drafts d_j drawn from q_j: d_j is accepted with probability
    min(1, p_j(d_j) / q_j(d_j)); the first rejected position samples the residual max(0, p_j - q_j),
    normalised; after all k, position k samples p_k. Writes the rows' tokens into `chosen` (rows past
    a rejection are left as they are: the accepted run ends there)."""
    dev = probs.device
    for j, d in enumerate(drafts):
        r = first + j
        p_r, q_r = probs[r], q[j].to(dev, torch.float32)
        if float(torch.rand(1, generator=gen, device=dev)) * float(q_r[d]) < float(p_r[d]):
            chosen[r] = d
            continue
        residual = (p_r - q_r).clamp_(min=0)
        residual[d] = 0.0
        if float(residual.sum()) <= 0:  # p = q up to rounding: p without d
            residual = p_r.clone()
            residual[d] = 0.0
        chosen[r] = torch.multinomial(residual, 1, generator=gen)[0]
        return
    r = first + len(drafts)
    chosen[r] = torch.multinomial(probs[r], 1, generator=gen)[0]


def inverse_cdf(cdf: torch.Tensor, u: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """Each row's token: the first whose running sum passes u * total. A token of probability 0
    (filtered out) leaves the sum where it was, so it is never the one; the greedy token guards the
    last-bit case of u * total rounding up to total."""
    sampled = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=cdf.shape[-1] - 1)
    before = cdf.gather(1, (sampled - 1).clamp(min=0)).masked_fill_(sampled == 0, 0.0)
    return torch.where(cdf.gather(1, sampled) > before, sampled, greedy[:, None])[:, 0]
