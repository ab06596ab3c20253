"""The speculative methods end to end on the tiny Llama (ngram, lookahead, draft_model with a one-layer
draft): greedy output is token-identical to speculation off in mixed batches, with chunked prefill,
prefix-cache hits and preemption, stops and max_tokens cut where they would; logprobs are the
target's; seeded random requests are reproducible; no block of either cache is left behind."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import random_prompts
from tests.fixtures import EOS
from tokenmill import LLM, SamplingParams

PROMPTS = random_prompts(5, 3, 40, seed=41)
REPEATS = [p[:6] * 4 for p in random_prompts(2, 6, 6, seed=42)]  # prompt lookup finds these
SHARED = random_prompts(1, 20, 20, seed=43)[0]
MODELS_DIR = Path(__file__).resolve().parents[2] / "models"  # the shipped demo models
ALL = PROMPTS + REPEATS + [SHARED + t for t in random_prompts(2, 2, 10, seed=44)]

METHODS = ["ngram", "lookahead", "draft_model"]
CONFIGS = {
    "mixed": dict(kv_cache_memory="8MiB"),
    "chunked_prefill": dict(kv_cache_memory="8MiB", max_num_batched_tokens=16, max_num_seqs=4),
    "preemption": dict(num_kv_blocks=14, max_model_len=96),
}


def tiny(model: str, **args: Any) -> LLM:
    return LLM(model, dtype="float32", block_size=8, num_threads=1, **args)


def spec_config(method: str, draft_dir: str, k: int = 3, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"method": method, "num_speculative_tokens": k, **extra}
    if method == "draft_model":
        cfg["model"] = draft_dir
    return cfg


def greedy_params() -> list[SamplingParams]:
    g = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return [g, g.clone(max_tokens=7), g.clone(logprobs=2), g.clone(repetition_penalty=1.5),
            g.clone(min_tokens=5, logit_bias={EOS: 40.0}, ignore_eos=False), g.clone(max_tokens=30),
            g.clone(max_tokens=3), g.clone(stop_token_ids=[], max_tokens=17), g.clone(max_tokens=12)]


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], cold: bool = True) -> list[Any]:
    if cold:
        assert llm.engine.reset_prefix_cache()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sched = llm.engine.core.scheduler
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks
    return [(c.token_ids, c.finish_reason, c.stop_reason, c.text,
             [[e[t].logprob for t in sorted(e)] for e in c.logprobs or []])
            for c in (o.outputs[0] for o in outs)]


# float32 products may add in another order at another batch shape (speculation verifies several rows of a
# request in one step), so logprobs agree to this, not bitwise; a logprob of the draft's or of another
# position differs by far more
LOGPROB_TOLERANCE = 1e-3


def assert_same(*runs: list[Any], label: str = "") -> None:
    """The runs' outputs equal, request by request: tokens, finish and stop reasons and text exactly,
    logprobs within LOGPROB_TOLERANCE; `label` names the case in a failure."""
    first = runs[0]
    for other in runs[1:]:
        assert len(other) == len(first)
        for i, (a, b) in enumerate(zip(first, other, strict=True)):
            assert a[:4] == b[:4], f"{label} request {i}"
            assert [len(e) for e in a[4]] == [len(e) for e in b[4]], f"{label} request {i}"
            for want, got in zip(a[4], b[4], strict=True):
                assert got == pytest.approx(want, abs=LOGPROB_TOLERANCE), f"{label} request {i}"


def draft_cache_is_free(llm: LLM) -> bool:
    """After the workers hear of the finished requests (with the next step's schedule)."""
    core = llm.engine.core
    core.executor.execute_model(core.scheduler.schedule())
    proposer = core.executor.runner.proposer.proposer
    if not hasattr(proposer, "blocks"):
        return True
    return proposer.num_free_blocks == proposer.blocks.num_blocks and not proposer.states


@pytest.fixture(scope="module")
def plain(llama_dir: str) -> Iterator[dict[str, list[Any]]]:
    out = {}
    for name, cfg in CONFIGS.items():
        llm = tiny(llama_dir, async_scheduling=False, **cfg)
        out[name] = run(llm, ALL, greedy_params())
    yield out


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("method", METHODS)
def test_greedy_output_is_the_same_as_without_speculation(method: str, config: str, llama_dir: str,
                                                          draft_dir: str, plain: dict[str, list[Any]]) -> None:
    llm = tiny(llama_dir, **CONFIGS[config],
              speculative_config=spec_config(method, draft_dir, adaptive=False))
    # async scheduling stays configured; without the adaptive rule every step runs one at a time
    assert llm.engine.config.scheduler.async_scheduling == tiny(llama_dir).engine.config.scheduler.async_scheduling
    sched = llm.engine.core.scheduler
    spec = run(llm, ALL, greedy_params())
    hits = sched.kv.prefix_hits
    again = run(llm, ALL, greedy_params(), cold=False)  # now from prefix-cache hits
    assert_same(plain[config], spec, again)
    assert sched.kv.prefix_hits > hits
    assert sched.spec.num_draft_tokens > 0 and sched.spec.num_accepted_tokens > 0
    if config == "preemption":
        assert sched.num_preemptions > 0
    assert draft_cache_is_free(llm)


def test_stops_inside_accepted_runs_cut_where_they_would(llama_dir: str, draft_dir: str) -> None:
    base = tiny(llama_dir, async_scheduling=False, kv_cache_memory="8MiB")
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full = run(base, REPEATS, [free] * 2)
    stop_token, stop_text = full[0][0][6], full[1][3][8:12]
    params = [free.clone(stop_token_ids=[stop_token]), free.clone(stop=[stop_text])]
    want = run(base, REPEATS, params)
    assert want[0][2] == stop_token and want[1][2] == stop_text
    for method in METHODS:
        llm = tiny(llama_dir, kv_cache_memory="8MiB",
                  speculative_config=spec_config(method, draft_dir, k=5, adaptive=False))
        assert_same(want, run(llm, REPEATS, params), label=method)
        assert draft_cache_is_free(llm)


@pytest.mark.parametrize("method", METHODS)
def test_seeded_random_requests_are_reproducible(method: str, llama_dir: str, draft_dir: str) -> None:
    llm = tiny(llama_dir, kv_cache_memory="8MiB",
              speculative_config=spec_config(method, draft_dir, adaptive=False))
    params = [SamplingParams(temperature=0.9, top_k=8, seed=60 + i, max_tokens=16, ignore_eos=True)
              for i in range(len(ALL))]
    first = run(llm, ALL, params)
    assert_same(first, run(llm, ALL, params))
    assert_same(first, run(llm, ALL[::-1], params[::-1])[::-1])  # whatever else runs beside it


def test_a_thousand_requests_aborted_at_random_leave_no_block_in_either_cache(llama_dir: str,
                                                                               draft_dir: str) -> None:
    llm = tiny(llama_dir, num_kv_blocks=64, max_num_seqs=32,
              speculative_config=spec_config("draft_model", draft_dir, k=4, adaptive=False,
                                             draft_kv_cache_memory=64 * 8 * 2 * 64 * 4 * 2))
    engine, sched = llm.engine, llm.engine.core.scheduler
    rng = random.Random(0)
    prompts = random_prompts(1000, 2, 30, seed=45)
    live: list[str] = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randint(2, 20), ignore_eos=True)
        live.append(engine.add_request(None, {"prompt_token_ids": prompt}, params))
        if i % 8 == 7:
            for _ in range(rng.randint(0, 3)):
                engine.step()
            doomed = rng.sample(live, k=min(len(live), rng.randint(0, 6)))
            engine.abort_request(doomed)
            live = [r for r in live if r not in doomed]
    while engine.has_unfinished_requests():
        engine.step()
    assert sched.spec.num_draft_tokens > 0
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks and not sched.kv.req_blocks
    assert draft_cache_is_free(llm)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_quantized_draft_leaves_the_greedy_output_as_it_was(llama_dir: str, draft_dir: str,
                                                              quantization: str) -> None:
    """speculative_config's `quantization` rounds the draft's weights at load (the target stays float): the draft
    proposes through the quantized kernels, and the target's verification keeps every token."""
    from tokenmill.layers.quantization import QuantizedLinearMethod

    params = greedy_params()
    prompts = [ALL[i % len(ALL)] for i in range(len(params))]
    want = run(tiny(llama_dir, **CONFIGS["mixed"]), prompts, params)
    llm = tiny(llama_dir, **CONFIGS["mixed"],
               speculative_config=spec_config("draft_model", draft_dir, k=4, adaptive=False, quantization=quantization))
    model = llm.engine.core.executor.worker.model_runner.proposer.proposer.model
    methods = {type(m.method) for m in model.modules() if hasattr(m, "method")}
    assert methods == {QuantizedLinearMethod}
    target = llm.engine.core.executor.worker.model
    assert not any(isinstance(getattr(m, "method", None), QuantizedLinearMethod) for m in target.modules())
    assert_same(want, run(llm, prompts, params))
    assert llm.engine.core.scheduler.spec.num_accepted_tokens > 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])  # 0: the draft's fused argmax (decode_greedy)
# float32: the fused path's float32 form (an AVX2-only CPU, where oneDNN packs float32 weights)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_draft_models_fused_steps_match_its_layer_loop(llama_dir: str, draft_dir: str,
                                                           temperature: float, dtype: str) -> None:
    """Where the draft takes the fused decode path: its proposals (catch-up feeds and one-token
    steps as decode rows in one C++ call) are bitwise those of its layer loop over the same rows, and the
    target's output is the same."""
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=20, ignore_eos=True) for i in range(len(ALL))]
    assert_fused_draft_matches_loop(llama_dir, draft_dir, dtype, ALL, params)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_shipped_drafts_fused_steps_match_its_layer_loop(temperature: float) -> None:
    """The same on the shipped bf16 pair in dtype auto: on a CPU without bf16 arithmetic the draft runs float32 with
    its weights in bf16 panels (the fused path's panels form), elsewhere bf16."""
    target, draft = (str(MODELS_DIR / name) for name in ("tokenmill-demo", "tokenmill-draft"))
    prompts = ["ROMEO.\nWhat light through yonder", "KING.\nNow is the winter of our", "To be, or not to be"]
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=24, ignore_eos=True) for i in range(3)]
    assert_fused_draft_matches_loop(target, draft, "auto", prompts, params)


def test_the_shipped_drafts_fused_steps_give_each_request_its_own_number_of_drafts() -> None:
    """Requests in one proposal that take 1, 4 and 2 drafts (the adaptive rule's max_drafts), each fused call
    for the requests still drafting: the drafts equal the layer loop's, and the draft's cache follows each
    request's tokens (a second proposal, after one draft taken and another token, agrees too)."""
    from tokenmill.kernels import load_cpu_kernels
    from tokenmill.spec_decode.proposer import ProposalInput

    if load_cpu_kernels() is None:
        pytest.skip("needs the C++ kernels")
    target, draft_dir = (str(MODELS_DIR / name) for name in ("tokenmill-demo", "tokenmill-draft"))
    results = []
    for reference in (False, True):
        llm = LLM(target, block_size=8, num_threads=1, kv_cache_memory="8MiB", async_scheduling=False,
                  speculative_config=spec_config("draft_model", draft_dir, k=4, adaptive=False))
        draft = llm.engine.core.executor.runner.proposer.proposer
        if draft.fused is None:
            pytest.skip("the draft model does not take the fused path on this machine")
        draft.rows_reference = reference
        texts = ("ROMEO.\nWhat light through", "KING.\nNow is the", "To be, or")
        tokens = [llm.get_tokenizer().encode(text) for text in texts]
        ids = ["a", "b", "c"]
        first = draft.propose(ProposalInput(ids, tokens, [1, 1, 1], max_drafts=[1, 4, 2]))
        grown = [t + first[rid][:1] + [7] for t, rid in zip(tokens, ids, strict=True)]  # one draft taken, then 7
        second = draft.propose(ProposalInput(ids, grown, [2, 2, 2], max_drafts=[3, 3, 4]))
        assert [len(first[r]) for r in ids] == [1, 4, 2] and [len(second[r]) for r in ids] == [3, 3, 4]
        draft.finished(set(ids))
        assert draft.num_free_blocks == draft.blocks.num_blocks
        results.append((first, second))
    assert results[0] == results[1]


def assert_fused_draft_matches_loop(target: str, draft_dir: str, dtype: str, prompts: list[Any],
                                    params: list[SamplingParams]) -> None:
    from tokenmill.kernels import load_cpu_kernels

    if load_cpu_kernels() is None:
        pytest.skip("needs the C++ kernels")
    results = []
    for reference in (False, True):
        llm = LLM(target, dtype=dtype, block_size=8, num_threads=1, kv_cache_memory="8MiB",
                  async_scheduling=False, speculative_config=spec_config("draft_model", draft_dir, k=3,
                                                                         adaptive=False))
        draft = llm.engine.core.executor.runner.proposer.proposer
        if draft.fused is None:
            pytest.skip("the draft model does not take the fused path on this machine")
        draft.rows_reference = reference
        proposals: list[dict[str, list[int]]] = []
        propose = draft.propose

        def recording(batch: Any, propose: Any = propose, proposals: list[Any] = proposals) -> Any:
            out = propose(batch)
            proposals.append({rid: list(d) for rid, d in out.items()})
            return out

        draft.propose = recording
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert sum(map(len, proposals)) > 10 and draft_cache_is_free(llm)
        results.append((outs, [sorted(p.items()) for p in proposals]))
    assert results[0] == results[1]
