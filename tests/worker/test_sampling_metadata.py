"""The sampling table against a plain recomputation from each request's parameters: rows written on
add and condensed on removal, batch-wide counts, and the per-step view (gathered rows, flags, the
rows that name a generator or processors, draft rows)."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.sampling_metadata import (
    SamplingRow,
    SamplingTable,
    is_plain_greedy,
    metadata_for,
    plain_greedy_from,
)

PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, min_tokens=2),
    SamplingParams(temperature=0.0, logprobs=3),
    SamplingParams(temperature=0.7, top_k=5, seed=3),
    SamplingParams(temperature=1.0, top_p=0.9, presence_penalty=0.5),
    SamplingParams(temperature=1.2, min_p=0.1, logprobs=0),
    SamplingParams(temperature=0.0, logit_bias={3: 1.0}, seed=1),
    SamplingParams(temperature=0.9),
]


def make_row(params: SamplingParams, num_tokens: int = 4) -> SamplingRow:
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    return SamplingRow(params, list(range(10, 10 + num_tokens)), 3, (0,), gen)


def expected_flags(rows: list[SamplingRow]) -> dict[str, object]:
    ps = [r.params for r in rows]
    return dict(
        temperature=[p.temperature or 1.0 for p in ps], top_k=[p.top_k for p in ps], top_p=[p.top_p for p in ps],
        min_p=[p.min_p for p in ps], greedy=[p.greedy for p in ps], all_greedy=all(p.greedy for p in ps),
        any_filter=any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in ps),
        all_plain_greedy=all(is_plain_greedy(r) for r in rows),
        logprobs=None if all(p.logprobs is None for p in ps) else [
            -1 if p.logprobs is None else p.logprobs for p in ps],
        generators=[i for i, r in enumerate(rows) if r.generator is not None],
        processors=[i for i, p in enumerate(ps) if p.min_tokens or p.logit_bias or p.needs_penalties],
    )


def flags_of(table: SamplingTable, req_ids: list[str]) -> dict[str, object]:
    meta = table.view(req_ids)
    f32 = [float(np.float32(x)) for x in meta.temperature.tolist()]
    return dict(
        temperature=f32, top_k=meta.top_k.tolist(), top_p=meta.top_p.tolist(), min_p=meta.min_p.tolist(),
        greedy=meta.greedy.tolist(), all_greedy=meta.all_greedy, any_filter=meta.any_filter,
        all_plain_greedy=meta.all_plain_greedy, logprobs=meta.logprobs,
        generators=[i for i, _ in meta.generators], processors=[i for i, _ in meta.processors],
    )


def as_f32(flags: dict[str, object]) -> dict[str, object]:
    out = dict(flags)
    for key in ("temperature", "top_p", "min_p"):
        out[key] = [float(np.float32(x)) for x in flags[key]]  # type: ignore[attr-defined]
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, len(PARAMS) - 1), st.integers(0, 3)), max_size=80),
       st.randoms(use_true_random=False))
def test_rows_and_counts_follow_adds_and_removes(ops: list[tuple[bool, int, int]], rnd: object) -> None:
    table = SamplingTable(capacity=2)  # grows as it fills
    live: dict[str, SamplingRow] = {}
    for n, (add, which, extra) in enumerate(ops):
        if add or not live:
            rid = f"r{n}"
            live[rid] = make_row(PARAMS[which], 3 + extra)
            table.add(rid, live[rid])
        else:
            rid = sorted(live)[which % len(live)]
            del live[rid]
            table.remove(rid)
        assert len(table) == len(live) and set(table.index) == set(live)
        assert all(table.rows[table.index[rid]] is row for rid, row in live.items())
        rows = list(live.values())
        assert table.num_random == sum(not r.params.greedy for r in rows)
        assert table.num_seeded == sum(r.generator is not None for r in rows)
        assert table.max_logprobs == max((r.params.logprobs for r in rows if r.params.logprobs is not None),
                                         default=None)
        if live:  # any subset, any order
            ids = list(live)
            rnd.shuffle(ids)  # type: ignore[attr-defined]
            ids = ids[:max(1, len(ids) // 2)]
            assert flags_of(table, ids) == as_f32(expected_flags([live[r] for r in ids]))


def test_min_tokens_rows_turn_plain_greedy_when_reached() -> None:
    table = SamplingTable()
    row = make_row(SamplingParams(temperature=0.0, min_tokens=2), num_tokens=3)  # 3 prompt tokens, none out
    table.add("a", row)
    table.add("b", make_row(SamplingParams(temperature=0.0)))
    assert plain_greedy_from(row.params, 3) == 5
    meta = table.view(["a", "b"])
    assert not meta.all_plain_greedy and table.view(["b"]).all_plain_greedy
    row.token_ids.extend([7, 8])  # taken after the view was built: it sees them when asked
    assert meta.all_plain_greedy
    assert table.view(["a"]).all_plain_greedy and not table._pending  # and the table forgets the row
    never = make_row(SamplingParams(temperature=0.0, logprobs=1))
    assert plain_greedy_from(never.params, 3) == math.inf


def test_a_request_with_drafts_takes_a_row_per_position() -> None:
    rows = [make_row(PARAMS[0]), make_row(PARAMS[4]), make_row(PARAMS[3]), make_row(PARAMS[7])]
    meta = metadata_for(rows, drafts={1: [40, 41], 2: [50]})
    assert meta.num_rows == 1 + 3 + 2 + 1 and meta.first_rows == [0, 1, 4, 6]
    assert meta.top_p.tolist() == [1.0] + [float(np.float32(0.9))] * 3 + [1.0] * 3
    assert meta.top_k.tolist() == [0, 0, 0, 0, 5, 5, 0]
    assert [(i, g is rows[2].generator, d) for i, g, d in meta.seeded_groups] == [(4, True, [50])]
    assert not meta.generators
    # request 1's penalties: each draft row sees the drafts before it as taken
    assert [(i, r.token_ids[4:]) for i, r in meta.processors] == [(1, []), (2, [40]), (3, [40, 41])]
    # the runs: drafts while each is its row's token, then that row's token
    assert meta.runs([5, 40, 9, 9, 50, 51, 6]) == [[5], [40, 9], [50, 51], [6]]
    assert meta.runs([5, 40, 41, 42, 7, 51, 6]) == [[5], [40, 41, 42], [7], [6]]


def test_steps_of_an_unchanged_batch_share_the_gathered_rows() -> None:
    """The per-row tensors are gathered once per layout of rows while the batch's requests stay the same, and
    again after a request is added or removed."""
    table = SamplingTable()
    table.add("a", make_row(PARAMS[0]))
    table.add("b", make_row(PARAMS[3]))
    first = table.view(["a", "b"])
    again = table.view(["a", "b"])
    assert again.temperature is first.temperature and again.greedy is first.greedy
    drafted = table.view(["a", "b"], drafts={0: [7, 8]})
    assert drafted.num_rows == 4 and drafted.temperature is not first.temperature
    table.add("c", make_row(PARAMS[7]))
    after = table.view(["a", "b"])
    assert after.temperature is not first.temperature and after.temperature.tolist() == first.temperature.tolist()
