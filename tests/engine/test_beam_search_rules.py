"""BeamSearchState's rules (transformers' beam search) on hand-made logprobs, without a model."""

from __future__ import annotations

import math

import pytest

from tokenmill import BeamSearchParams, Logprob
from tokenmill.engine.beam_search import BeamSearchState
from tokenmill.outputs import PositionLogprobs

EOS = 0


def top(*pairs: tuple[int, float]) -> PositionLogprobs:
    """A position's logprobs: (token, logprob) pairs given best first."""
    return {tid: Logprob(lp, rank) for rank, (tid, lp) in enumerate(pairs, start=1)}


def state(width: int, max_tokens: int, length_penalty: float = 1.0, ignore_eos: bool = False) -> BeamSearchState:
    params = BeamSearchParams(width, max_tokens, ignore_eos=ignore_eos, length_penalty=length_penalty)
    return BeamSearchState([5, 6, 7], params, [EOS], max_model_len=100)


def test_candidates_and_requests() -> None:
    s = state(2, 5)
    assert s.num_candidates == 4 and s.pending() == [[5, 6, 7]]
    s.advance([top((10, -0.1), (11, -0.2), (12, -3.0), (13, -4.0))])
    assert s.pending() == [[5, 6, 7, 10], [5, 6, 7, 11]]
    # across beams: 11's child (-0.2 - 0.1) beats 10's second token (-0.1 - 1.0)
    s.advance([top((20, -0.5), (21, -1.0), (22, -2.0), (23, -2.5)),
               top((30, -0.1), (31, -2.0), (32, -2.1), (33, -2.2))])
    assert s.pending() == [[5, 6, 7, 11, 30], [5, 6, 7, 10, 20]]
    assert [b.cum_logprob for b in s.live] == pytest.approx([-0.3, -0.6])


def test_eos_finishes_only_from_the_top_width_ranks() -> None:
    s = state(2, 5)
    # EOS at rank 3 of the 4 candidates: dropped, neither finished nor live
    s.advance([top((10, -0.1), (11, -0.2), (EOS, -0.3), (13, -4.0))])
    assert s.finished == [] and s.pending() == [[5, 6, 7, 10], [5, 6, 7, 11]]
    # EOS at rank 1: finished (score cum / 2 tokens), and the next two live beams go on
    s.advance([top((EOS, -0.1), (21, -1.0), (22, -1.1), (23, -5.0)),
               top((30, -1.5), (31, -2.0), (32, -2.1), (33, -2.2))])
    assert [(score, beam.tokens, reason) for score, beam, reason in s.finished] == [
        (pytest.approx(-0.1), [10, EOS], "stop")]
    assert s.pending() == [[5, 6, 7, 10, 21], [5, 6, 7, 10, 22]]


def test_ignore_eos_keeps_eos_as_a_token() -> None:
    s = state(2, 5, ignore_eos=True)
    s.advance([top((EOS, -0.1), (11, -0.2), (12, -3.0), (13, -4.0))])
    assert s.finished == [] and s.pending() == [[5, 6, 7, EOS], [5, 6, 7, 11]]


def test_max_tokens_finishes_the_top_width_with_length_penalty() -> None:
    s = state(2, 2, length_penalty=0.5)
    s.advance([top((10, -0.1), (11, -0.2), (12, -3.0), (13, -4.0))])
    s.advance([top((20, -0.5), (21, -1.0), (22, -2.0), (23, -2.5)),
               top((30, -0.1), (31, -2.0), (32, -2.1), (33, -2.2))])
    assert s.done and s.pending() == []
    out = s.result()
    assert [q.output_token_ids for q in out.sequences] == [[11, 30], [10, 20]]
    assert [q.finish_reason for q in out.sequences] == ["length", "length"]
    assert [q.score for q in out.sequences] == pytest.approx([-0.3 / math.sqrt(2), -0.6 / math.sqrt(2)])
    assert out.sequences[0].tokens == [5, 6, 7, 11, 30] and out.sequences[0].num_prompt_tokens == 3


def test_stops_when_the_best_live_beam_cannot_beat_the_worst_finished() -> None:
    s = state(2, 10)
    s.advance([top((EOS, -0.1), (EOS + 1, -0.2), (12, -3.0), (13, -4.0))])  # one finished, 1 and 12 live
    assert not s.done
    # 1's EOS (-0.2 - 0.1 over 2 tokens = -0.15) finishes: two finished; the best live beam, 1 -> 40
    # at -0.2 - 0.9 = -1.1 over 2 tokens, cannot beat -0.15
    s.advance([top((EOS, -0.1), (40, -0.9), (41, -1.0), (42, -2.0)),
               top((50, -0.5), (51, -1.0), (52, -2.0), (53, -2.5))])
    assert s.done
    assert [(q.output_token_ids, q.finish_reason) for q in s.result().sequences] == [
        ([EOS], "stop"), ([1, EOS], "stop")]


def test_goes_on_while_a_live_beam_can_still_win() -> None:
    s = state(2, 10)
    s.advance([top((EOS, -0.1), (EOS + 1, -0.2), (12, -0.3), (13, -4.0))])
    # 1 -> EOS (rank 2) finishes at -0.25 / 2 = -0.125; the best live beam, 1 -> 40 at -0.21 / 2 =
    # -0.105, can still beat it: the search goes on with two finished
    s.advance([top((40, -0.01), (EOS, -0.05), (41, -1.0), (42, -2.0)),
               top((50, -0.01), (51, -1.0), (52, -2.0), (53, -2.5))])
    assert len(s.finished) == 2 and not s.done
    assert s.pending() == [[5, 6, 7, 1, 40], [5, 6, 7, 12, 50]]


def test_max_tokens_is_bounded_by_the_model_length() -> None:
    s = BeamSearchState([5, 6, 7], BeamSearchParams(2, 50), [EOS], max_model_len=4)
    s.advance([top((10, -0.1), (11, -0.2), (12, -3.0), (13, -4.0))])
    assert s.done and [q.finish_reason for q in s.result().sequences] == ["length", "length"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=2.0, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
    (dict(beam_width=2, max_tokens=4, ignore_eos=1), "ignore_eos"),
])
def test_params_are_validated(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**kwargs)  # type: ignore[arg-type]
