"""The adaptive rule in front of a proposer, and Predicted Outputs' per-request reference drafts.

Speculation pays where a step is bound by reading the weights (small batches) and costs where it is
bound by compute (large ones): every draft is a row the target computes. Per step:

- with more than `max_batch_size` requests taking tokens, nothing is proposed;
- else each request keeps an estimate `a` of the chance that a draft is accepted once the drafts before
  it were: accepted drafts over drafts the target checked (those accepted, and the one it rejected, if
  any), both counts decayed by 0.7 a verified step, starting at 0.5 / 1. It gets the largest k' <= k
  for which the chance that its k'-th draft is accepted, a ** k', is at least the step's threshold
  B / (2 * max_batch_size) + c (B: the requests taking tokens). A draft is worth a ** k' of a token,
  a token a B-th of a step; it costs a verification row (the first term) and a draft position's share
  of proposing: c, the proposer's seconds per draft position over the seconds of the step that verified
  them (an EWMA, weight 0.2, over drafted steps: near 0 for prompt lookup, more for a proposer that runs
  a model of its own). A request whose estimate gives k' = 0 still gets one draft every `PROBE_EVERY` steps, so
  the estimate can recover. (Accepted over proposed would not do for `a`: the drafts after a rejection
  are never checked, so that fraction reads 0.66 for a draft accepted 87% of the time at k = 6.)

On top of that, a measured gate (`CostGate`) per batch size (its power of two): the tokens a second
of steps that verified drafts (the step's time, plus the proposing that drafted them) against steps that
did not, each mode's rate its last GATE_WINDOW steps' tokens over their seconds. A ratio of sums, not a
typical step's rate: acceptance comes in runs (a quoted passage copied, then nothing), and the rate of a
typical step follows the steps that took one token however many the others took. A step that took over
GATE_OUTLIER times the window's median seconds is left out (a pause of the host's must not turn the gate,
whose other mode is measured again only at its next probe). A proposer that runs a model of its own
reports the part of its proposing spent catching that model up on tokens it has not seen (`catchup_s`: after
steps without drafts, a request's new tokens); the gate leaves it out, since it is paid once when proposing
resumes, not in every drafted step, and counting it would hold the gate on the plain side after every probe.
Where proposing is measured slower, the method proposes nothing in that bucket, with one step in
GATE_PROBE_EVERY spent on the other mode so that its estimate can recover (drafting, where its steps measure
under GATE_FAR_RATIO of the plain rate, one step in GATE_FAR_OVERLAP). Steps with prefill rows are not
measured. A step the gate keeps plain is reported (`gated`, ModelRunnerOutput.spec_gated): the engine then
overlaps its next steps (async scheduling; none of them proposes), 1 after the gate's first refusal and
twice as many after each further one, up to GATE_PROBE_EVERY (GATE_FAR_OVERLAP where drafted steps measure under
GATE_FAR_RATIO of the plain rate: there a probe costs more than it can find, above all a draft model's, which
catches up on the tokens of every request it drafts for), until it chooses to draft again; the first
proposal after steps that were not asked to propose (`ProposalInput.resumed`) probes the drafts. (A lone
refusal where drafting pays costs one plain step; a batch size where it does not runs overlapped.)

A request with a reference text (SamplingParams.prediction_token_ids, from OpenAI's `prediction`) is
drafted from it by prompt lookup, whatever the configured method and without the rule."""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenmill.config import SpeculativeConfig
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.ngram import lookup
from tokenmill.spec_decode.proposer import ProposalInput, Proposer

EWMA_WEIGHT = 0.3  # each verified step's weight in a request's acceptance counts
PRIOR = 0.5
PROBE_EVERY = 8
DRAFT_COST_WEIGHT = 0.2  # each drafted step's weight in the proposer's measured cost


@dataclass
class _Acceptance:
    accepted: float = PRIOR  # decayed count of the request's drafts the target accepted
    checked: float = 1.0  # decayed count of its drafts the target checked (accepted, or the one rejected)
    idle: int = 0  # steps since the request last got a draft

    @property
    def rate(self) -> float:
        """The chance that a draft is accepted once the drafts before it were."""
        return self.accepted / self.checked

    def verified(self, accepted: int, proposed: int) -> None:
        """A step's verification: `accepted` of the `proposed` drafts, in order (one more was checked and
        rejected, unless all were taken)."""
        keep = 1.0 - EWMA_WEIGHT
        self.accepted = keep * self.accepted + accepted
        self.checked = keep * self.checked + accepted + (accepted < proposed)


GATE_WINDOW = 9  # the steps of each mode whose rate a bucket compares
GATE_OUTLIER = 3.0  # a step over this many times its window's median seconds is left out of the rate
GATE_MIN_STEPS = 3  # steps of each mode a bucket measures before it chooses
GATE_PROBE_EVERY = 32  # one step in this many runs the mode the gate did not choose
# where drafted steps measure under GATE_FAR_RATIO of the plain steps' rate, the overlapped runs between probes
# grow on to GATE_FAR_OVERLAP steps
GATE_FAR_RATIO = 0.75
GATE_FAR_OVERLAP = 128


@dataclass
class _Rate:
    recent: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=GATE_WINDOW))  # (tokens, seconds)

    def add(self, tokens: int, seconds: float) -> None:
        self.recent.append((tokens, max(seconds, 1e-9)))

    @property
    def steps(self) -> int:
        """The steps measured, up to GATE_WINDOW (GATE_MIN_STEPS is below it)."""
        return len(self.recent)

    @property
    def rate(self) -> float:
        """Tokens a second over the window, without its outliers (at least half the steps are kept)."""
        limit = GATE_OUTLIER * statistics.median(s for _, s in self.recent)
        kept = [(t, s) for t, s in self.recent if s <= limit]
        return sum(t for t, _ in kept) / sum(s for _, s in kept)


@dataclass
class _Bucket:
    plain: _Rate = field(default_factory=_Rate)
    spec: _Rate = field(default_factory=_Rate)
    decisions: int = 0

    def compare(self) -> tuple[bool, bool] | None:
        """(drafted steps measure at least the plain rate, they measure under GATE_FAR_RATIO of it), once both
        modes have GATE_MIN_STEPS; else None."""
        if self.spec.steps < GATE_MIN_STEPS or self.plain.steps < GATE_MIN_STEPS:
            return None
        spec, plain = self.spec.rate, self.plain.rate
        return spec >= plain, spec < GATE_FAR_RATIO * plain


class CostGate:
    """Whether proposing pays at a batch size: measured tokens per second with drafts against without."""

    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}

    def observe(self, batch: int, tokens: int, seconds: float, verified: bool) -> None:
        """A measured step of `batch` requests that took `tokens` in `seconds` (with the proposing
        before it); verified: it verified drafts."""
        bucket = self.buckets.setdefault(batch.bit_length(), _Bucket())
        (bucket.spec if verified else bucket.plain).add(tokens, seconds)

    def pays(self, batch: int, resumed: bool = False) -> bool:
        """Whether to propose for the next step of `batch` requests; resumed: steps ran without being asked
        to propose since the last decision (the engine overlapped them), so this one probes the drafts."""
        bucket = self.buckets.setdefault(batch.bit_length(), _Bucket())
        bucket.decisions += 1
        if bucket.spec.steps < GATE_MIN_STEPS or resumed:
            return True
        compared = bucket.compare()
        if compared is None:  # the plain side not measured yet
            return False
        better, far = compared
        # a probe of the other mode; of drafting, where it is far behind, as seldom as the longest overlapped runs
        return better != (bucket.decisions % (GATE_FAR_OVERLAP if far else GATE_PROBE_EVERY) == 0)

    def far_behind(self, batch: int) -> bool:
        """Whether drafted steps at this batch size measure under GATE_FAR_RATIO of the plain rate."""
        compared = self.buckets.setdefault(batch.bit_length(), _Bucket()).compare()
        return compared is not None and compared[1]


def adaptive_k(rate: float, k: int, batch: int, max_batch_size: int, draft_cost: float = 0.0) -> int:
    """The drafts a request with this acceptance estimate gets in a step of `batch` requests, where proposing
    costs `draft_cost` of a step per draft position."""
    if batch > max_batch_size:
        return 0
    threshold = batch / (2 * max_batch_size) + draft_cost
    n = 0
    while n < k and rate ** (n + 1) >= threshold:
        n += 1
    return n


class SpecDecoder:
    """The model runner's proposer: the configured method's (None: Predicted Outputs only), under the
    adaptive rule."""

    def __init__(self, spec: SpeculativeConfig | None, proposer: Proposer | None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.spec, self.proposer, self.clock = spec, proposer, clock
        self.gate = CostGate() if spec is not None and spec.adaptive else None
        self.propose_s = 0.0  # how long the last propose() took
        self.positions = 0  # the draft positions the last propose() asked its proposer for (0: not called)
        self.draft_cost: float | None = None  # c above (None: not measured yet)
        self.gated = 0  # where the gate chose plain steps in the last propose(): the steps the engine may overlap
        self.refusals = 0  # the gate's refusals since it last chose to draft (probes aside)
        self.k = spec.num_speculative_tokens if spec is not None else 0
        self.needs_hidden_states = bool(getattr(proposer, "needs_hidden_states", False))
        self.acceptance: dict[str, _Acceptance] = {}
        self.proposed: dict[str, int] = {}  # the drafts each request got last step
        self.predicting: set[str] = set()  # the requests with a reference text

    @property
    def active(self) -> bool:
        """Whether a step's proposal can give anything (else the runner skips it)."""
        return self.proposer is not None or bool(self.predicting)

    def added(self, req_id: str, params: SamplingParams) -> None:
        if params.prediction_token_ids:
            self.predicting.add(req_id)

    @property
    def draft_probs(self) -> dict[str, Any]:
        return getattr(self.proposer, "draft_probs", {})

    def finished(self, req_ids: set[str]) -> None:
        for rid in req_ids:
            self.acceptance.pop(rid, None)
            self.proposed.pop(rid, None)
            self.predicting.discard(rid)
        done = getattr(self.proposer, "finished", None)
        if done is not None:
            done(req_ids)

    def propose(self, batch: ProposalInput) -> dict[str, list[int]]:
        start = self.clock()
        if self.proposer is not None and hasattr(self.proposer, "catchup_s"):
            self.proposer.catchup_s = 0.0  # (a step that does not reach the proposer has none)
        try:
            return self._propose(batch)
        finally:
            catchup = getattr(self.proposer, "catchup_s", 0.0) if self.proposer is not None else 0.0
            self.propose_s = max(0.0, self.clock() - start - catchup)

    def _propose(self, batch: ProposalInput) -> dict[str, list[int]]:
        self.gated = 0
        out: dict[str, list[int]] = {}
        own: list[int] = []  # the requests the method drafts for
        if self.gate is not None and batch.step_s is not None:
            verified = any(self.proposed.get(rid) for rid in batch.req_ids)
            self.gate.observe(len(batch.req_ids), sum(batch.num_new_tokens), batch.step_s + self.propose_s, verified)
        if self.positions and batch.step_s:
            cost = self.propose_s / self.positions / batch.step_s
            self.draft_cost = cost if self.draft_cost is None else self.draft_cost + DRAFT_COST_WEIGHT * (
                cost - self.draft_cost)
        self.positions = 0
        for i, rid in enumerate(batch.req_ids):
            self._observe(rid, batch.num_new_tokens[i])
            params = batch.sampling_params[i] if batch.sampling_params is not None else None
            reference = params.prediction_token_ids if params is not None else None
            if reference:
                drafts = lookup(batch.token_ids[i], max(self.k, 8), 1, 3, reference)
                if drafts:
                    out[rid] = drafts
                    self.proposed[rid] = len(drafts)
            else:
                own.append(i)
        if self.proposer is None or not own or self.spec is None:
            return out
        batch.max_drafts = [0] * len(batch.req_ids)
        if self.gate is not None and not self.gate.pays(len(batch.req_ids), batch.resumed):
            self.refusals += 1
            cap = GATE_FAR_OVERLAP if self.gate.far_behind(len(batch.req_ids)) else GATE_PROBE_EVERY
            self.gated = min(cap, 2 ** (self.refusals - 1))
            return out
        if not batch.resumed:  # (a probe says nothing of the gate's choice)
            self.refusals = 0
        for i in own:
            rid = batch.req_ids[i]
            acc = self.acceptance.setdefault(rid, _Acceptance())
            k = self.k
            if self.spec.adaptive:
                k = adaptive_k(acc.rate, self.k, len(batch.req_ids), self.spec.max_batch_size, self.draft_cost or 0.0)
                if k == 0 and acc.idle >= PROBE_EVERY and len(batch.req_ids) <= self.spec.max_batch_size:
                    k = 1
            batch.max_drafts[i] = k
            acc.idle = 0 if k else acc.idle + 1
        if not any(batch.max_drafts):
            return out
        place = {rid: i for i, rid in enumerate(batch.req_ids)}
        for rid, drafts in self.proposer.propose(batch).items():
            i = place[rid]
            if rid not in out and drafts and batch.max_drafts[i] > 0:
                out[rid] = drafts[:batch.max_drafts[i]]
                self.proposed[rid] = len(out[rid])
                self.positions = max(self.positions, len(out[rid]))  # (none drafted: no cost to measure)
        return out

    def _observe(self, rid: str, taken: int) -> None:
        """The step's verification of the drafts rid got last step: taken - 1 of them accepted."""
        n = self.proposed.pop(rid, 0)
        if n and (acc := self.acceptance.get(rid)) is not None:
            acc.verified(min(taken - 1, n), n)
