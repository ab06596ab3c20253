"""Each grammar backend (xgrammar, guidance) on its own: compilation in the pool (a request is not ready
until its grammar is, one compilation per grammar, an LRU of them), bitmask rows for draft tokens, the
speculative-decoding API (validate k drafts, roll back), the end of a grammar ending its request, and a bad
grammar."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tokenmill.core.messages import SchedulerStats
from tokenmill.core.request import Request
from tokenmill.engine.input_processor import load_tokenizer
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.structured.backend import GrammarBackend
from tokenmill.structured.bitmask import allowed_ids
from tokenmill.structured.grammar import grammar_key
from tokenmill.structured.guidance import GuidanceBackend
from tokenmill.structured.xgrammar_backend import XGrammarBackend

from ..fixtures import EOS, VOCAB


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: str) -> Any:
    return load_tokenizer(tokenizer_dir)


@pytest.fixture(params=["xgrammar", "guidance"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def make(kind: str, load: Any, **kw: Any) -> GrammarBackend:
    if kind == "guidance":
        return GuidanceBackend(load, VOCAB, (EOS,), **kw)
    return XGrammarBackend(load, VOCAB, **kw)


@pytest.fixture
def backend(tokenizer: Any, kind: str) -> Any:
    """A factory of backends of the kind (keyword arguments: the backend's)."""
    return lambda **kw: make(kind, lambda: tokenizer, **kw)


def request(rid: str, **constraint: Any) -> Request:
    return Request(rid, [5, 6], SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)), (EOS,))


def ready(b: GrammarBackend, req: Request) -> None:
    b.compile(grammar_key(req.sampling_params.structured_outputs)).result(timeout=60)  # type: ignore[arg-type]
    assert b.is_ready(req)


def masks(b: GrammarBackend, reqs: list[Request], drafts: dict[str, list[int]]) -> dict[str, Any]:
    """The step's bitmasks, waited for where the backend fills them on its thread."""
    out = b.grammar_bitmask(reqs, drafts)
    return out if isinstance(out, dict) else out.result(timeout=60)


def encode(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def test_a_request_is_ready_once_its_grammar_is_compiled_in_the_pool(backend: Any) -> None:
    gate = threading.Event()
    b = backend(cache_size=2)
    b._pool.submit(gate.wait)  # holds the pool's one thread: the compilations queue behind it
    req, twin = request("a", regex="[0-9]+"), request("b", regex="[0-9]+")
    assert not b.is_ready(req) and not b.is_ready(twin)  # never blocks the caller
    assert b.is_ready(request("free", regex="x").__class__("free", [1], SamplingParams()))  # unconstrained
    gate.set()
    ready(b, req)
    assert b.is_ready(twin) and len(b.compile_seconds) == 1  # one compilation for both
    stats = SchedulerStats()
    b.count_into(stats)  # the metrics' counters: two requests, one compilation
    assert stats.structured_requests == {"regex": 2} and stats.grammar_compiles == 1
    assert stats.grammar_compile_seconds == pytest.approx(sum(b.compile_seconds.values()))
    assert not stats.structured_failed
    for regex in ("a", "b"):  # an LRU of two: "[0-9]+" is pushed out
        b.compile(grammar_key(StructuredOutputsParams(regex=regex))).result(timeout=60)
    assert grammar_key(StructuredOutputsParams(regex="[0-9]+")) not in b._compiled
    b.shutdown()


def test_prepare_loads_the_tokenizer_once_in_the_pool_before_any_compilation(tokenizer: Any, kind: str) -> None:
    loads: list[int] = []

    def load() -> Any:
        loads.append(1)
        return tokenizer

    b = make(kind, load)
    b.prepare().result(timeout=60)
    assert loads == [1] and b.num_compiles == 0  # nothing compiled yet
    req = request("a", regex="[0-9]+")
    ready(b, req)
    assert loads == [1] and b.num_compiles == 1  # the compilation reuses what prepare loaded
    b.shutdown()


def test_a_grammar_that_cannot_be_built_is_a_value_error(backend: Any) -> None:
    b = backend()
    req = request("bad", grammar="root ::= nothing")
    with pytest.raises(ValueError, match="invalid grammar"):
        b.compile(grammar_key(req.sampling_params.structured_outputs)).result(timeout=60)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="invalid grammar"):
        b.is_ready(req)
    stats = SchedulerStats()
    b.count_into(stats)
    assert stats.structured_failed == 1 and stats.grammar_compiles == 1 and stats.structured_requests == {}


def test_rows_for_drafts_validate_and_rollback(backend: Any, tokenizer: Any) -> None:
    b = backend()
    req = request("a", choice=["yes please", "no thanks"])
    ready(b, req)
    yes, no = encode(tokenizer, "yes please"), encode(tokenizer, "no thanks")
    [first] = masks(b, [req], {}).values()
    assert {yes[0], no[0]} <= set(allowed_ids(first[0]).tolist())
    drafts = yes[:2] + [no[0]]  # the third draft breaks the grammar
    rows = masks(b, [req], {"a": drafts})["a"]
    assert rows.shape[0] == 4 and (rows[0] == first[0]).all()
    for j in (0, 1, 2):  # row j: after the first j drafts
        assert allowed_ids(rows[j]).tolist() == sorted({yes[j]} | ({no[0]} if j == 0 else set()))
    assert (rows[3] == rows[2]).all()  # past the draft the grammar rejects: a copy
    assert b.validate_tokens("a", drafts) == 2 and b.validate_tokens("a", yes) == len(yes)
    assert (masks(b, [req], {})["a"] == first).all()  # validating left the state as it was
    assert not b.accept_tokens(req, yes[:2])
    b.rollback("a", 2)  # as if the two drafts were taken, then rejected
    assert (masks(b, [req], {})["a"] == first).all()


def test_a_step_loop_fill_gives_the_rows_the_fill_thread_gives(backend: Any, tokenizer: Any) -> None:
    """fill_on_step_loop (the model on the CPU): a step whose tokens were all told is filled before
    grammar_bitmask returns, as a dict; the same rows as the fill thread's, step after step."""
    threaded, inline = backend(), backend(fill_on_step_loop=True)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}}
    reqs = {b: [request("a", json=schema), request("b", regex="[0-9]+")] for b in (threaded, inline)}
    for b in (threaded, inline):
        for req in reqs[b]:
            ready(b, req)
    text = '{"name": "ab", "n": 12}'
    for tok_a, tok_b in zip(encode(tokenizer, text)[:6], encode(tokenizer, "123456")[:6], strict=False):
        direct = inline.grammar_bitmask(reqs[inline], {})
        assert isinstance(direct, dict)
        via_thread = masks(threaded, reqs[threaded], {})
        assert direct.keys() == via_thread.keys() == {"a", "b"}
        for rid in direct:
            assert (direct[rid] == via_thread[rid]).all()
        for b in (threaded, inline):
            for req, tok in zip(reqs[b], (tok_a, tok_b), strict=True):
                req.append_output_token(tok)
                assert not b.accept_tokens(req, [tok])


@pytest.mark.parametrize("on_step_loop", [True, False], ids=["step_loop", "fill_thread"])
def test_a_fill_that_waits_for_tokens_is_filled_when_the_last_is_told(backend: Any, tokenizer: Any,
                                                                      on_step_loop: bool) -> None:
    """Async scheduling: a step scheduled before its requests' last tokens are told gets a Future, filled once
    the accept_tokens (or free) that tells the last of them: inside it on the step loop, else on the fill
    thread; the rows equal those of a step scheduled after."""
    b = backend(fill_on_step_loop=on_step_loop)
    reqs = [request("a", regex="[0-9]+x"), request("b", regex="[0-9]+x"), request("c", regex="[0-9]+x")]
    for req in reqs:
        ready(b, req)
    [one] = encode(tokenizer, "1")
    for req in reqs:  # the tokens of the step in flight and of this one, not sampled yet
        req.num_output_placeholders = 2
    pending = b.grammar_bitmask(reqs, {})
    assert not isinstance(pending, dict) and not pending.done()
    for req in reqs[:2]:  # the step in flight's
        req.num_output_placeholders -= 1
        req.append_output_token(one)
        assert not b.accept_tokens(req, [one]) and not pending.done()
    b.free("c")  # aborted: nothing more to wait for
    assert pending.done() or not on_step_loop
    rows = pending.result(timeout=60)
    after = masks(b, reqs[:2], {})
    assert (rows["a"] == after["a"]).all() and (rows["b"] == after["b"]).all()
    assert one in allowed_ids(rows["a"][0]).tolist() and (rows["c"] == -1).all()


def test_the_end_of_the_grammar_ends_the_request(backend: Any, tokenizer: Any) -> None:
    b = backend()
    done, open_ended = request("a", choice=["yes"]), request("b", regex="a+")
    ready(b, done)
    ready(b, open_ended)
    *head, last = encode(tokenizer, "yes")
    assert not head or not b.accept_tokens(done, head)
    assert b.accept_tokens(done, [last])  # nothing but EOS may follow
    assert not b.accept_tokens(open_ended, encode(tokenizer, "aa"))  # complete, but more "a" may follow
    b.free("a")
    assert masks(b, [done], {}) == {}


@pytest.mark.parametrize(("constraint", "says"), [
    ({"json": {"type": "nope"}}, "invalid JSON schema"), ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "a(b"}, "invalid regex"), ({"grammar": "root ::= missing"}, "invalid grammar"),
])
def test_the_library_refuses_a_bad_constraint_with_a_value_error(constraint: dict[str, Any], says: str,
                                                                 kind: str) -> None:
    from types import SimpleNamespace
    from typing import cast

    from tokenmill.config import ModelConfig
    from tokenmill.engine.input_processor import InputProcessor, ProcessedPrompt

    config = SimpleNamespace(arch=SimpleNamespace(eos_token_ids=(EOS,), vocab_size=VOCAB), max_model_len=64)
    processor = InputProcessor(cast(ModelConfig, config), None, kind)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match=says):
        processor.make_request("r", ProcessedPrompt(None, [5, 6]), params)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
