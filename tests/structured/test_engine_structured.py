"""Each grammar backend (xgrammar, guidance) in the engine, on the tiny model: constrained outputs stay
valid with n > 1, stop strings, prefix caching, preemption (the matcher keeps its state across recompute),
draft tokens (wrong ones and right ones give the same tokens), and async scheduling; nothing is left behind."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from tests.spec_decode.test_spec_decode import Garbage, Oracle
from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured.backend import GrammarBackend
from tokenmill.structured.guidance import GuidanceBackend
from tokenmill.structured.xgrammar_backend import XGrammarBackend

BACKENDS = {"xgrammar": XGrammarBackend, "guidance": GuidanceBackend}

SCHEMA: dict[str, Any] = {"type": "object", "properties": {
    "kind": {"enum": ["cat", "dog"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "xs": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}, "required": ["kind", "n", "xs"]}
PROMPTS = ["def main(argv):\n    parser = argparse.ArgumentParser(description='tool')", "import os\nimport sys\n" * 3,
           "class A:\n    def __init__(self, x, y):\n        self.x = x", "for x in range(10):\n    print(x, y, z)"]


def constrained(seed: int | None = None, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=80,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), **kw)


def check_valid(outputs: list[Any]) -> None:
    for out in outputs:
        for comp in out.outputs:
            assert comp.finish_reason == "stop", comp.text
            jsonschema.validate(json.loads(comp.text), SCHEMA)


def backend_of(llm: LLM) -> GrammarBackend:
    backend = llm.engine.core.scheduler.structured_output
    assert type(backend) is BACKENDS[llm.engine.config.structured_outputs.backend]
    return backend


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def make_llm(llama_dir: str, backend: str, **kw: Any) -> LLM:
    args: dict[str, Any] = {"num_kv_blocks": 64, **kw}
    return LLM(llama_dir, dtype="float32", block_size=8, max_model_len=128, structured_outputs_config={
        "backend": backend}, **({"async_scheduling": False} | args))


@pytest.fixture(scope="module")
def llm(llama_dir: str, backend: str) -> LLM:
    return make_llm(llama_dir, backend)


def test_n_and_seeds_and_the_free_requests_beside(llm: LLM) -> None:
    free = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    outs = llm.generate(PROMPTS * 2, [constrained(seed=i, n=3) for i in range(4)] +
                        [SamplingParams(temperature=0.0, max_tokens=8)] * 4, use_tqdm=False)
    check_valid(outs[:4])
    assert all(len(o.outputs) == 3 for o in outs[:4])
    assert [o.outputs[0].token_ids for o in outs[4:]] == [o.outputs[0].token_ids for o in free]
    assert not backend_of(llm)._matchers  # every request's matcher freed


def test_stop_strings_and_prefix_caching(llm: LLM) -> None:
    whole = llm.generate(PROMPTS, constrained(), use_tqdm=False)
    check_valid(whole)
    again = llm.generate(PROMPTS, constrained(), use_tqdm=False)  # the prompts are prefix-cache hits now
    assert [o.outputs[0].text for o in again] == [o.outputs[0].text for o in whole]
    assert all(o.num_cached_tokens >= 8 for o in again)
    cut = llm.generate(PROMPTS, constrained(stop=['"n"']), use_tqdm=False)
    for c, w in zip(cut, whole, strict=True):
        assert w.outputs[0].text.startswith(c.outputs[0].text) and '"n"' not in c.outputs[0].text
    assert not backend_of(llm)._matchers


def test_preemption_keeps_the_grammar_state(llama_dir: str, backend: str) -> None:
    roomy = make_llm(llama_dir, backend)
    tight = make_llm(llama_dir, backend, num_kv_blocks=18)
    params = [constrained(seed=i) for i in range(8)]
    want = roomy.generate(PROMPTS * 2, params, use_tqdm=False)
    got = tight.generate(PROMPTS * 2, params, use_tqdm=False)
    assert tight.engine.core.scheduler.num_preemptions > 0
    check_valid(got)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_draft_tokens_wrong_or_right_give_the_same_tokens(llm: LLM) -> None:
    runner = llm.engine.core.executor.runner
    plain = llm.generate(PROMPTS, constrained(), use_tqdm=False)
    check_valid(plain)
    sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in plain]
    for proposer in (Garbage(3), Oracle(sequences, 4)):
        runner.set_proposer(proposer)
        try:
            got = llm.generate(PROMPTS, constrained(), use_tqdm=False)
        finally:
            runner.set_proposer(None)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]


def test_async_scheduling(llama_dir: str, backend: str) -> None:
    sync = make_llm(llama_dir, backend)
    overlapped = make_llm(llama_dir, backend, async_scheduling=True)
    params = [constrained(seed=i) for i in range(4)] + [SamplingParams(temperature=0.0, max_tokens=20)] * 4
    want = sync.generate(PROMPTS * 2, params, use_tqdm=False)
    got = overlapped.generate(PROMPTS * 2, params, use_tqdm=False)
    check_valid(got[:4])
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
