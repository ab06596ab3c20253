"""The token bitmask stage of the sampler: every token it gives is allowed by its row's bitmask, for
greedy, seeded and unseeded sampling, with filters, penalties and drafts; it runs before the C++
argmax, which would not see it; rows without a bitmask sample as they would with none given."""

from __future__ import annotations

import random
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.bitmask import pack_allowed
from tokenmill.worker.sampler import Sampler, apply_token_bitmask
from tokenmill.worker.sampling_metadata import SamplingRow, SamplingTable, metadata_for

VOCAB = 70  # not a multiple of 32: the last word is partly past the vocabulary


def row(params: SamplingParams) -> SamplingRow:
    gen = None if params.seed is None else torch.Generator().manual_seed(params.seed)
    return SamplingRow(params, [3, 4, 5, 6], 2, (0,), gen)


def test_bitmask_masks_the_clear_bits_and_what_lies_past_it() -> None:
    logits = torch.zeros(3, VOCAB)
    masks = [pack_allowed([0, 31, 32, 69], VOCAB), pack_allowed(range(VOCAB), VOCAB), pack_allowed([5], 64)]
    bitmask = torch.from_numpy(np.stack([np.pad(m, (0, 3 - len(m)), constant_values=0) for m in masks]))
    apply_token_bitmask(logits, bitmask)
    assert torch.isfinite(logits[0]).nonzero()[:, 0].tolist() == [0, 31, 32, 69]
    assert bool(torch.isfinite(logits[1]).all())
    assert torch.isfinite(logits[2]).nonzero()[:, 0].tolist() == [5]
    mixed = torch.arange(4 * VOCAB, dtype=torch.float32).reshape(4, VOCAB)
    unconstrained = np.full(3, -1, np.int32)  # every bit set: how a step's rows without a grammar are filled
    apply_token_bitmask(mixed, torch.from_numpy(np.stack([unconstrained, bitmask[0].numpy(), unconstrained,
                                                          bitmask[2].numpy()])))
    assert torch.equal(mixed[0], torch.arange(VOCAB, dtype=torch.float32))
    assert torch.equal(mixed[2], torch.arange(2 * VOCAB, 3 * VOCAB, dtype=torch.float32))
    assert torch.isfinite(mixed[1]).nonzero()[:, 0].tolist() == [0, 31, 32, 69]
    assert torch.isfinite(mixed[3]).nonzero()[:, 0].tolist() == [5] and mixed[3, 5] == 3 * VOCAB + 5
    short = torch.zeros(1, VOCAB)
    apply_token_bitmask(short, torch.from_numpy(pack_allowed(range(64), 64))[None])  # 2 words: 64 tokens
    assert torch.isfinite(short[0]).nonzero()[:, 0].tolist() == list(range(64))


PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, seed=11),
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.0, top_k=3, top_p=0.8, seed=5),
    SamplingParams(temperature=0.0, presence_penalty=1.0, logprobs=2),
]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded", "random", "filtered", "penalised"])
def test_every_token_is_allowed(params: SamplingParams) -> None:
    rng = random.Random(0)
    torch.manual_seed(0)
    for trial in range(40):
        logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(trial)) * 4
        allowed = [set(rng.sample(range(VOCAB), rng.randint(1, 6))) for _ in range(6)]
        bitmasks = {i: pack_allowed(a, VOCAB)[None] for i, a in enumerate(allowed)}
        out = Sampler()(logits, metadata_for([row(params) for _ in range(6)], bitmasks=bitmasks))
        for (tok,), ok, lg in zip(out.token_ids, allowed, logits, strict=True):
            assert tok in ok
            if params.temperature == 0.0 and not params.needs_penalties:
                assert tok == max(ok, key=lambda t: float(lg[t]))  # the argmax among the allowed


def test_rows_without_a_bitmask_sample_as_without_any() -> None:
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    params = [PARAMS[i % len(PARAMS)].clone(seed=100 + i) for i in range(8)]  # every row seeded

    def sample(bitmasks: dict[int, np.ndarray] | None) -> list[list[int]]:
        return Sampler()(logits, metadata_for([row(p) for p in params], bitmasks=bitmasks)).token_ids

    free = sample(None)
    constrained = sample({1: pack_allowed([7], VOCAB)[None], 4: pack_allowed([9, 10], VOCAB)[None]})
    assert constrained[1] == [7] and constrained[4][0] in (9, 10)
    assert [t for i, t in enumerate(constrained) if i not in (1, 4)] == [t for i, t in enumerate(free)
                                                                       if i not in (1, 4)]


def test_the_cpp_argmax_is_skipped_where_a_bitmask_is_set() -> None:
    from tokenmill.kernels import load_cpu_kernels

    ops = load_cpu_kernels()
    assert ops is not None
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2)).bfloat16()
    rows = [row(SamplingParams(temperature=0.0)) for _ in range(4)]
    banned_best = pack_allowed(set(range(VOCAB)) - {int(logits[0].float().argmax())}, VOCAB)
    meta = metadata_for(rows, bitmasks={0: banned_best[None]})
    assert not meta.all_plain_greedy
    out = Sampler(ops)(logits, meta).token_ids
    assert out[0] != [int(logits[0].float().argmax())]
    assert out[1:] == [[int(lg.float().argmax())] for lg in logits[1:]]


def test_a_bitmask_row_per_draft_position() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, 20] = 10.0  # the unconstrained argmax everywhere
    mask = np.stack([pack_allowed([4, 5], VOCAB), pack_allowed([6], VOCAB), pack_allowed([7, 8], VOCAB)])
    logits[0, 5] = logits[2, 8] = 1.0
    meta = metadata_for([row(SamplingParams(temperature=0.0))], drafts={0: [5, 6]}, bitmasks={0: mask})
    assert Sampler()(logits, meta).token_ids == [[5, 6, 8]]
    meta = metadata_for([row(SamplingParams(temperature=0.0))], drafts={0: [4, 6]}, bitmasks={0: mask})
    assert Sampler()(logits, meta).token_ids == [[5]]


@pytest.mark.parametrize("constrained", [[0, 1, 2], [2, 0], [1]])
def test_the_steps_bitmask_holds_each_requests_rows_at_its_rows(constrained: list[int]) -> None:
    """Every request constrained (its masks given in another order than the requests') or some: request i's
    rows where its rows are (after request i-1's draft rows), every bit set in the rows of the others."""
    drafts = {0: [5, 6], 2: [7]}
    rng = np.random.default_rng(0)
    masks = {i: rng.integers(-2**31, 2**31, (1 + len(drafts.get(i, [])), 3), dtype=np.int64).astype(np.int32)
             for i in constrained}
    meta = metadata_for([row(SamplingParams(temperature=0.0)) for _ in range(3)], drafts=drafts, bitmasks=masks)
    assert meta.bitmask is not None
    want = np.concatenate([masks.get(i, np.full((1 + len(drafts.get(i, [])), 3), -1, np.int32)) for i in range(3)])
    assert np.array_equal(meta.bitmask.numpy(), want)


@pytest.mark.parametrize("fails", [False, True])
def test_bitmasks_written_for_a_call_that_waits_for_them(fails: bool) -> None:
    """bitmask_written: the thread that completes the fill writes the step's bitmask into the rows and then
    releases the flag; where the fill failed, the flag is released too (the call ends) and take_written raises."""
    table = SamplingTable()
    for rid in ("a", "b"):
        table.add(rid, row(SamplingParams(temperature=0.0)))
    pending: Future[dict[str, np.ndarray]] = Future()
    meta = table.view(["a", "b"], None, pending)
    released: list[int] = []
    rows, ready = meta.bitmask_written(3, lambda flag: released.append(int(flag.item())))
    assert not released
    mask = pack_allowed([4, 5], VOCAB)[None]
    if fails:
        pending.set_exception(ValueError("the fill failed"))
    else:
        pending.set_result({"b": mask})
    assert released == [0]  # (the flag's value when release was called: release sets it)
    if fails:
        with pytest.raises(ValueError, match="the fill failed"):
            meta.take_written(rows)
        return
    meta.take_written(rows)
    assert meta.bitmask is rows and np.array_equal(rows.numpy(), np.concatenate([np.full((1, 3), -1), mask]))
