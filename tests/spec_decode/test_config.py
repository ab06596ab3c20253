"""speculative_config is validated once at start-up, one clear error per mistake; speculation turns
async scheduling off; the registry knows every method the config accepts; a proposer that asks for
hidden states gets the target's, at the row that gave each request's newest token."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import SPECULATIVE_METHODS, EngineArgs, SpeculativeConfig
from tokenmill.spec_decode.adaptive import (
    GATE_FAR_OVERLAP,
    GATE_FAR_RATIO,
    GATE_PROBE_EVERY,
    CostGate,
    SpecDecoder,
    adaptive_k,
)
from tokenmill.spec_decode.proposer import ProposalInput
from tokenmill.spec_decode.registry import PROPOSERS


def config_error(model: str, spec: Any) -> str:
    with pytest.raises(ValueError) as e:
        EngineArgs(model, speculative_config=spec).create_engine_config()
    return str(e.value)


def test_the_registry_has_every_method_the_config_accepts() -> None:
    assert set(PROPOSERS) == set(SPECULATIVE_METHODS)


def test_bad_configs_are_one_clear_error(llama_dir: str, draft_dir: str, model_dirs: dict[str, str],
                                         tmp_path: Any) -> None:
    assert "method 'eagle9' unknown" in config_error(llama_dir, {"method": "eagle9", "num_speculative_tokens": 2})
    assert "num_speculative_tokens must be an integer >= 1" in config_error(
        llama_dir, {"method": "ngram", "num_speculative_tokens": 0})
    assert "unknown field" in config_error(llama_dir, {"method": "ngram", "num_speculative_tokens": 2, "kk": 1})
    assert "not valid JSON" in config_error(llama_dir, "{method: ngram}")
    assert "prompt_lookup_min" in config_error(llama_dir, {"method": "ngram", "num_speculative_tokens": 2,
                                                           "prompt_lookup_min": 4, "prompt_lookup_max": 2})
    assert 'needs "model"' in config_error(llama_dir, {"method": "draft_model", "num_speculative_tokens": 2})
    larger = {"method": "draft_model", "num_speculative_tokens": 2, "model": llama_dir}
    assert "not smaller than the target" in config_error(draft_dir, larger)
    other_vocab = str(tmp_path / "vocab")
    shutil.copytree(draft_dir, other_vocab)
    with open(os.path.join(other_vocab, "config.json")) as f:
        cfg = json.load(f)
    cfg["vocab_size"] = 1024
    with open(os.path.join(other_vocab, "config.json"), "w") as f:
        json.dump(cfg, f)
    assert "vocabulary (1024 tokens)" in config_error(
        llama_dir, {"method": "draft_model", "num_speculative_tokens": 2, "model": other_vocab})
    other_tok = str(tmp_path / "tok")
    shutil.copytree(draft_dir, other_tok)
    with open(os.path.join(other_tok, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    with open(os.path.join(other_tok, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    assert "another tokenizer" in config_error(
        llama_dir, {"method": "draft_model", "num_speculative_tokens": 2, "model": other_tok})
    assert "quantization applies to a draft model's weights, not to method 'ngram'" in config_error(
        llama_dir, {"method": "ngram", "num_speculative_tokens": 2, "quantization": "int8"})
    assert "the draft model: quantization 'int3' unknown; choose from" in config_error(
        llama_dir, {"method": "draft_model", "num_speculative_tokens": 2, "model": draft_dir, "quantization": "int3"})
    assert "the draft model: --quantization gptq: config.json has no quantization_config" in config_error(
        llama_dir, {"method": "draft_model", "num_speculative_tokens": 2, "model": draft_dir, "quantization": "gptq"})


def test_medusa_without_its_module_fails_at_start_with_a_clear_error(llama_dir: str, tmp_path: Any,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    if importlib.util.find_spec("tokenmill.spec_decode.medusa") is not None:
        monkeypatch.setitem(sys.modules, "tokenmill.spec_decode.medusa", None)  # as if it were missing
    with pytest.raises((ValueError, ImportError)) as e:
        LLM(llama_dir, dtype="float32", num_threads=1, kv_cache_memory="8MiB",
            speculative_config={"method": "medusa", "num_speculative_tokens": 2, "model": str(tmp_path)})
    assert "medusa" in str(e.value)


def test_speculation_keeps_async_scheduling(llama_dir: str) -> None:
    # the engine runs the steps one at a time only while it proposes (engine/core.py: EngineCore.step)
    for chosen in (True, False):
        cfg = EngineArgs(llama_dir, async_scheduling=chosen,
                         speculative_config={"method": "ngram", "num_speculative_tokens": 2}).create_engine_config()
        assert cfg.scheduler.async_scheduling is chosen


def test_the_cli_takes_the_flag_and_reports_a_bad_one_in_one_line(llama_dir: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(__file__), "..", "..", "src")}
    done = subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", "bench", "latency", "--model", llama_dir,
                           "--speculative-config", '{"method": "nope", "num_speculative_tokens": 2}'],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0
    assert "method 'nope' unknown" in done.stderr and "Traceback" not in done.stderr


def test_the_adaptive_rule_shrinks_k_with_batch_and_acceptance() -> None:
    assert adaptive_k(0.9, 4, 1, 32) == 4
    assert adaptive_k(0.9, 4, 16, 32) == 4 and adaptive_k(0.6, 4, 16, 32) == 2 and adaptive_k(0.4, 4, 16, 32) == 1
    assert adaptive_k(0.05, 4, 1, 32) == 1 and adaptive_k(0.01, 4, 1, 32) == 0
    assert adaptive_k(1.0, 4, 33, 32) == 0  # past max_batch_size: nothing


@pytest.mark.parametrize("taken_drafts", [2, 6])
def test_a_requests_acceptance_estimate_counts_the_drafts_the_target_checked(taken_drafts: int) -> None:
    """Steps of six drafts of which the first `taken_drafts` are accepted: the target checked those and the
    one after (all six when every one is taken), so the estimate tends to taken / (taken + 1), or to 1, not
    to taken / 6; at batch 1 that keeps all six drafts ((2/3) ** 6 >= 1/64), where taken / 6 would not."""

    class Six(Always):
        def propose(self, batch: ProposalInput) -> dict[str, list[int]]:
            return {"a": [1, 2, 3, 4, 5, 6][:(batch.max_drafts or [6])[0]]}

    decoder = SpecDecoder(SpeculativeConfig(method="ngram", num_speculative_tokens=6), Six())
    sizes, taken = [], 1
    for _ in range(40):
        drafts = decoder.propose(ProposalInput(["a"], [[1, 2, 3]], [taken], step_s=None)).get("a", [])
        sizes.append(len(drafts))
        taken = min(taken_drafts, len(drafts)) + 1
    expected = 1.0 if taken_drafts == 6 else taken_drafts / (taken_drafts + 1)
    assert decoder.acceptance["a"].rate == pytest.approx(expected, abs=1e-3)
    assert sizes[-10:] == [6] * 10
    assert taken_drafts == 6 or adaptive_k(taken_drafts / 6, 6, 1, 32) < 6  # what accepted / proposed would give


def test_a_proposer_that_costs_a_quarter_step_a_position_gets_fewer_drafts() -> None:
    """Proposing takes 0.25 s per draft position, steps 1 s: the rule measures c = 0.25 and gives a request
    accepting 3 in a row (estimate 0.75) the largest k' with 0.75 ** k' >= 1/64 + 0.25: 4, not 6."""
    now = [0.0]

    class Costly(Always):
        def propose(self, batch: ProposalInput) -> dict[str, list[int]]:
            assert batch.max_drafts is not None
            now[0] += 0.25 * max(batch.max_drafts)
            return {rid: [1, 2, 3, 4, 5, 6][:k] for rid, k in zip(batch.req_ids, batch.max_drafts, strict=True) if k}

    decoder = SpecDecoder(SpeculativeConfig(method="ngram", num_speculative_tokens=6), Costly(), clock=lambda: now[0])
    assert decoder.gate is not None
    decoder.gate.pays = lambda batch, resumed=False: True  # type: ignore[method-assign]
    sizes, taken = [], 1
    for _ in range(30):
        drafts = decoder.propose(ProposalInput(["a"], [[1, 2, 3]], [taken], step_s=1.0)).get("a", [])
        sizes.append(len(drafts))
        taken = min(3, len(drafts)) + 1
    assert decoder.draft_cost == pytest.approx(0.25)
    assert sizes[-5:] == [4] * 5


class Always:
    """Two drafts for every request."""

    def propose(self, batch: ProposalInput) -> dict[str, list[int]]:
        return {rid: [1, 2][:k] for rid, k in zip(batch.req_ids, batch.max_drafts or [2] * len(batch.req_ids),
                                                   strict=True) if k}


@pytest.mark.parametrize("spec_pays", [True, False])
def test_the_cost_gate_proposes_where_drafted_steps_take_more_tokens_a_second(spec_pays: bool) -> None:
    """Steps with drafts take 3 tokens in 2 s (or in 4 s), steps without 1 token in 1 s: the gate keeps
    proposing where that pays and stops where it does not, probing the other mode one step in
    GATE_PROBE_EVERY; another batch size is measured apart; unmeasured steps count for nothing."""
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    decoder = SpecDecoder(cfg, Always(), clock=lambda: 0.0)
    drafted = []
    for _ in range(5 * GATE_PROBE_EVERY):
        verified = bool(decoder.proposed)
        batch = ProposalInput(["a"], [[1, 2, 3]], [3 if verified else 1], step_s=(2.0 if spec_pays else 4.0)
                              if verified else 1.0)
        drafted.append(bool(decoder.propose(batch)))
    tail = drafted[16:]
    probes = sum(1 for i in range(16, len(drafted)) if (i + 1) % GATE_PROBE_EVERY == 0)  # the i-th decision
    assert probes == 5 and sum(tail) == (len(tail) - probes if spec_pays else probes)
    # a batch of 2 is its own bucket: it starts by proposing; a step without a time is not measured
    assert decoder.propose(ProposalInput(["a", "b"], [[1], [2]], [1, 1], step_s=None))
    assert decoder.gate is not None and decoder.gate.buckets[2].plain.steps == 0


def test_the_cost_gate_probes_after_steps_that_were_not_asked_to_propose() -> None:
    """Plain pays at batch 1, so the gate refuses and its proposer reports how many steps the engine may overlap,
    twice as many at each refusal since it last chose to draft; the first decision after overlapped steps
    (resumed) drafts."""
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    decoder = SpecDecoder(cfg, Always(), clock=lambda: 0.0)
    assert decoder.gate is not None
    for verified in [True] * 3 + [False] * 3:
        decoder.gate.observe(1, 3 if verified else 1, 4.0 if verified else 1.0, verified)
    overlaps = []
    for _ in range(8):  # refused, then the probe after the overlapped steps: 1, 2, 4 ... up to GATE_PROBE_EVERY
        assert not decoder.propose(ProposalInput(["a"], [[1, 2, 3]], [3], step_s=None))
        overlaps.append(decoder.gated)
        assert decoder.propose(ProposalInput(["a"], [[1, 2, 3]], [3], step_s=None, resumed=True))
        assert decoder.gated == 0
    assert overlaps == [1, 2, 4, 8, 16, 32, 32, 32]


@pytest.mark.parametrize("drafted_s", [4.0, 8.0])
def test_the_overlapped_runs_grow_longer_where_drafting_is_far_behind(drafted_s: float) -> None:
    """Drafted steps take 3 tokens in 4 s (0.75 of the plain rate, 1 token in 1 s) or in 8 s (0.375): the runs of
    overlapped steps between probes stop at GATE_PROBE_EVERY in the first case and grow on to GATE_FAR_OVERLAP in
    the second, under GATE_FAR_RATIO."""
    assert GATE_FAR_RATIO == 0.75 and GATE_FAR_OVERLAP == 4 * GATE_PROBE_EVERY
    decoder = SpecDecoder(SpeculativeConfig(method="ngram", num_speculative_tokens=2), Always(), clock=lambda: 0.0)
    assert decoder.gate is not None
    for verified in [True] * 3 + [False] * 3:
        decoder.gate.observe(1, 3 if verified else 1, drafted_s if verified else 1.0, verified)
    overlaps = []
    for _ in range(9):
        assert not decoder.propose(ProposalInput(["a"], [[1, 2, 3]], [3], step_s=None))
        overlaps.append(decoder.gated)
        assert decoder.propose(ProposalInput(["a"], [[1, 2, 3]], [3], step_s=None, resumed=True))
    cap = GATE_PROBE_EVERY if drafted_s == 4.0 else GATE_FAR_OVERLAP
    assert overlaps == [min(cap, 2 ** i) for i in range(9)]


@pytest.mark.parametrize("drafted_s", [4.0, 8.0])
def test_a_gate_far_behind_probes_drafting_seldom(drafted_s: float) -> None:
    """A synchronous engine asks the gate at every step: where drafted steps measure at 0.75 of the plain rate it
    probes drafting one decision in GATE_PROBE_EVERY, where they measure at 0.375 one in GATE_FAR_OVERLAP."""
    gate = CostGate()
    for verified in [True] * 3 + [False] * 3:
        gate.observe(1, 3 if verified else 1, drafted_s if verified else 1.0, verified)
    probes = sum(gate.pays(1) for _ in range(2 * GATE_FAR_OVERLAP))
    assert probes == 2 * GATE_FAR_OVERLAP // (GATE_PROBE_EVERY if drafted_s == 4.0 else GATE_FAR_OVERLAP)


def test_one_slow_step_does_not_turn_the_cost_gate() -> None:
    """Drafted steps take 3 tokens in 4 s, plain ones 1 token in 1 s: plain pays, and one plain step of 100 s
    (the host pausing the process) leaves it so: a step far slower than its mode's recent ones is left out."""
    gate = CostGate()
    for verified in [True] * 3 + [False] * 3:
        gate.observe(1, 3 if verified else 1, 4.0 if verified else 1.0, verified)
    assert not gate.pays(1)
    gate.observe(1, 1, 100.0, False)
    assert not gate.pays(1)


def test_the_cost_gate_counts_the_tokens_of_runs_of_acceptance() -> None:
    """Acceptance in runs: of nine drafted steps, five take 1 token in 1.1 s and four take 5 tokens in 1.2 s
    (25 tokens in 10.3 s), plain steps 1 token in 1 s. Drafting pays 2.4 times over, though most drafted steps
    alone are slower than a plain one (a median of the steps' rates would turn the gate to plain)."""
    gate = CostGate()
    for _ in range(3):
        gate.observe(1, 1, 1.0, False)
    for taken in [1, 5, 1, 5, 1, 5, 1, 5, 1]:
        gate.observe(1, taken, 1.1 if taken == 1 else 1.2, True)
    assert gate.pays(1)


def test_the_cost_gate_leaves_out_a_proposers_catch_up() -> None:
    """A proposer that spent 3 of its 4 s catching its model up on unseen tokens: the drafted step's cost the
    gate measures leaves those 3 s out; a later step that does not reach the proposer subtracts nothing."""
    now = [0.0]

    def clock() -> float:  # each reading a second after the one before, besides the proposer's own time
        now[0] += 1.0
        return now[0]

    class CatchingUp(Always):
        catchup_s = 0.0

        def propose(self, batch: ProposalInput) -> dict[str, list[int]]:
            now[0] += 4.0
            self.catchup_s = 3.0
            return super().propose(batch)

    decoder = SpecDecoder(SpeculativeConfig(method="ngram", num_speculative_tokens=2), CatchingUp(), clock=clock)
    assert decoder.propose(ProposalInput(["a"], [[1, 2, 3]], [1], step_s=1.0))
    assert decoder.propose_s == 2.0  # 1 + 4 - 3
    predicted = SamplingParams(prediction_token_ids=[4, 5])  # drafted from its reference: no proposer call
    decoder.propose(ProposalInput(["a"], [[1, 2, 3]], [1], step_s=1.0, sampling_params=[predicted]))
    assert decoder.propose_s == 1.0


def test_the_draft_model_reports_its_catch_up(llama_dir: str, draft_dir: str) -> None:
    """The draft's first proposal for a request feeds it the whole prompt: part of that proposal's time is
    catch-up; a proposal whose feeds are one token each has none."""
    cfg = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3}
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="8MiB", speculative_config=cfg)
    proposer = llm.engine.core.executor.worker.model_runner.proposer.proposer
    tokens = list(range(5, 60))
    drafts = proposer.propose(ProposalInput(["r"], [tokens], [len(tokens)], step_s=None))["r"]
    assert proposer.catchup_s > 0
    # every draft taken, and the token after them: the draft is fed its last draft and that token, no catch-up
    tokens += drafts + [9]
    assert proposer.propose(ProposalInput(["r"], [tokens], [len(drafts) + 1], step_s=None))
    assert proposer.catchup_s == 0.0
    assert proposer.propose(ProposalInput(["s"], [[7]], [1], step_s=None)) and proposer.catchup_s == 0.0


def test_the_draft_model_spreads_a_catch_up_over_steps(llama_dir: str, draft_dir: str) -> None:
    """With a feed budget of 10 tokens, three new requests (prompts of 5, 30 and 40 tokens): the first call feeds
    the shortest prompt whole and drafts for it, the next prompt the budget's other 5 tokens, the last none; later calls
    go on catching up, the shortest feed first. The drafts each request gets once caught up are the ones an
    unbudgeted proposer gives it from its whole prompt in one call."""
    cfg = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 3}
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="8MiB", speculative_config=cfg)
    proposer = llm.engine.core.executor.worker.model_runner.proposer.proposer
    prompts = {"a": list(range(5, 10)), "b": list(range(40, 70)), "c": list(range(100, 140))}
    whole = {rid: proposer.propose(ProposalInput([rid], [ids], [len(ids)], step_s=None))[rid]
             for rid, ids in prompts.items()}
    proposer.finished(set(prompts))
    assert proposer.num_free_blocks == proposer.blocks.num_blocks

    proposer.feed_budget = 10
    batch = ProposalInput(["c", "b", "a"], [prompts["c"], prompts["b"], prompts["a"]], [40, 30, 5], step_s=None)
    assert proposer.propose(batch) == {"a": whole["a"]}
    assert [len(proposer.states[rid].seq) for rid in "abc"] == [5 + 2, 5, 0]  # a holds its fed drafts too
    got: dict[str, list[int]] = {}
    for _ in range(8):
        got.update({rid: d for rid, d in proposer.propose(batch).items() if rid not in got})
    assert got == whole
    proposer.finished(set(prompts))
    assert proposer.num_free_blocks == proposer.blocks.num_blocks


def test_a_large_batch_proposes_nothing(llama_dir: str) -> None:
    llm = LLM(llama_dir, dtype="float32", num_threads=1, kv_cache_memory="16MiB",
              speculative_config={"method": "lookahead", "num_speculative_tokens": 3, "max_batch_size": 4})
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5 + i, 6, 7, 8]} for i in range(12)], params, use_tqdm=False)
    assert llm.engine.core.scheduler.spec.num_drafts == 0
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)
    assert llm.engine.core.scheduler.spec.num_drafts > 0


class HiddenChecker:
    """Checks that each request's hidden state gives its newest token through lm_head (greedy)."""

    needs_hidden_states = True

    def __init__(self, model: Any) -> None:
        self.model, self.checked = model, 0

    def propose(self, batch: ProposalInput) -> dict[str, list[int]]:
        assert batch.hidden_states is not None and batch.hidden_states.shape[0] == len(batch.req_ids)
        newest = self.model.compute_logits(batch.hidden_states).argmax(dim=-1).tolist()
        assert newest == [t[-1] for t in batch.token_ids]
        self.checked += len(newest)
        return {rid: [t[-1]] * 2 for rid, t in zip(batch.req_ids, batch.token_ids, strict=True)}


def test_a_proposer_that_needs_hidden_states_gets_the_newest_tokens(llama_dir: str) -> None:
    llm = LLM(llama_dir, dtype="float32", num_threads=1, kv_cache_memory="8MiB", async_scheduling=False,
              max_num_batched_tokens=16)
    runner = llm.engine.core.executor.runner
    checker = HiddenChecker(runner.model)
    runner.set_proposer(checker)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with torch.inference_mode():
        llm.generate([{"prompt_token_ids": [5 + i] * (3 + 7 * i)} for i in range(4)], params, use_tqdm=False)
    assert checker.checked > 4 * 4
