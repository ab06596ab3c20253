"""KV transfer between two engines in this process (a producer and a consumer over the ZMQ connector on
127.0.0.1): the consumer's greedy tokens equal transformers', prefix hits on either side shrink what is
computed or sent, and a producer or consumer that goes away mid-transfer leaves the survivor with every
block free (the consumer computes the prompt itself)."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest

from tests.conftest import random_prompts
from tests.entrypoints.server import free_port
from tests.fixtures import hf_expected
from tokenmill import SamplingParams
from tokenmill.config import EngineArgs
from tokenmill.core.messages import KVTransferParams
from tokenmill.engine.input_processor import KVSharing
from tokenmill.engine.llm_engine import LLMEngine

BLOCK = 8
NUM_BLOCKS = 40
MAX_TOKENS = 6
PREFIX = random_prompts(1, 40, 40, seed=21)[0]  # five full blocks
PROMPTS = [PREFIX + t for t in random_prompts(3, 3, 9, seed=22)]
_ids = itertools.count()


def engine(model_dir: str, role: str, port: int, block_size: int = BLOCK, async_scheduling: bool = False,
           **extra: Any) -> LLMEngine:
    config = {"kv_role": role, "kv_port": port, "kv_connector_extra_config": extra}
    return LLMEngine.from_engine_args(EngineArgs(model=model_dir, dtype="float32", block_size=block_size,
                                                 num_kv_blocks=NUM_BLOCKS, max_model_len=128,
                                                 async_scheduling=async_scheduling, kv_transfer_config=config))


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def prefill(producer: LLMEngine, prompt: list[int]) -> tuple[str, list[int]]:
    """The producer's half: the prompt and its first token, blocks kept under the returned id."""
    rid = f"p{next(_ids)}"
    producer.add_request(rid, {"prompt_token_ids": prompt}, greedy(1),
                         kv=KVSharing(transfer=KVTransferParams(do_remote_decode=True)))
    tokens: list[int] = []
    deadline = time.monotonic() + 30
    while producer.has_unfinished_requests():
        assert time.monotonic() < deadline
        for out in producer.step():
            tokens = out.outputs[0].token_ids
    return rid, tokens


def decode(consumer: LLMEngine, prompt: list[int], remote: str, port: int, *others: LLMEngine,
           until: Any = None) -> list[int]:
    """The consumer's half, stepping `others` (the producer) meanwhile; `until(consumer)` stops them."""
    rid = f"c{next(_ids)}"
    params = KVTransferParams(do_remote_prefill=True, remote_host="127.0.0.1", remote_port=port,
                              remote_request_id=remote)
    consumer.add_request(rid, {"prompt_token_ids": prompt}, greedy(), kv=KVSharing(transfer=params))
    tokens: list[int] = []
    deadline = time.monotonic() + 60
    while consumer.has_unfinished_requests():
        assert time.monotonic() < deadline, "the consumer hangs"
        for other in others:
            if until is None or not until(consumer):
                other.step()
        for out in consumer.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
    return tokens


def all_free(eng: LLMEngine) -> bool:
    core = eng.core
    return (not core.has_unfinished_requests() and not core.scheduler.held
            and core.scheduler.kv.num_free_blocks == core.num_blocks)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def pair(llama_dir: str, request: pytest.FixtureRequest) -> Any:
    # with async scheduling the consumer's pulled blocks are written by a step scheduled while another runs
    port = free_port()
    producer = engine(llama_dir, "kv_producer", port, async_scheduling=request.param)
    consumer = engine(llama_dir, "kv_consumer", free_port(), async_scheduling=request.param, transfer_timeout_s=10.0)
    yield producer, consumer, port
    producer.core.shutdown()
    consumer.core.shutdown()


@pytest.fixture(scope="module")
def want(llama_dir: str) -> list[list[int]]:
    return hf_expected(llama_dir, PROMPTS, [MAX_TOKENS] * len(PROMPTS))


def test_disaggregated_greedy_equals_transformers_with_prefix_hits(pair: Any, want: list[list[int]]) -> None:
    producer, consumer, port = pair
    got, received, computed = [], [], []
    for prompt in PROMPTS:
        before_rx = consumer.core.scheduler.stats().kv_transfer_blocks_received
        before_hits = producer.core.scheduler.kv.prefix_hits
        remote, first = prefill(producer, prompt)
        assert remote in producer.core.scheduler.held  # kept for the consumer
        tokens = decode(consumer, prompt, remote, port, producer)
        assert tokens[:1] == first  # the producer's first token, then the consumer's
        got.append(tokens)
        received.append(consumer.core.scheduler.stats().kv_transfer_blocks_received - before_rx)
        computed.append(producer.core.scheduler.kv.prefix_hits - before_hits)
    assert got == want
    # the first prompt moved all its blocks; the others share five full blocks with it on both sides: the
    # producer hit them in its prefix cache, the consumer had them and pulled only the rest
    assert received[0] == -(-len(PROMPTS[0]) // BLOCK)
    assert all(r == -(-len(p) // BLOCK) - 5 for r, p in zip(received[1:], PROMPTS[1:], strict=True))
    assert computed[0] == 0 and all(c == 5 * BLOCK for c in computed[1:])
    stats = consumer.core.scheduler.stats()
    assert stats.kv_transfer_failures == 0 and stats.kv_transfer_seconds > 0
    assert stats.kv_transfer_bytes_received == producer.core.scheduler.stats().kv_transfer_bytes_sent > 0
    assert all_free(producer) and all_free(consumer)


def test_unpulled_blocks_are_freed_after_the_hold_timeout(llama_dir: str) -> None:
    producer = engine(llama_dir, "kv_both", free_port(), hold_timeout_s=0.3)
    try:
        remote, _ = prefill(producer, PROMPTS[0])
        assert remote in producer.core.scheduler.held
        time.sleep(0.4)
        producer.step()
        assert all_free(producer)
    finally:
        producer.core.shutdown()


def test_producer_gone_mid_transfer_consumer_computes_the_prompt(llama_dir: str, want: list[list[int]]) -> None:
    port = free_port()
    producer = engine(llama_dir, "kv_producer", port, blocks_per_step=1)
    consumer = engine(llama_dir, "kv_consumer", free_port(), transfer_timeout_s=0.5)
    try:
        remote, _ = prefill(producer, PROMPTS[2])

        def some_blocks_in(c: LLMEngine) -> bool:
            return c.core.scheduler.stats().kv_transfer_blocks_received >= 2

        def dies(c: LLMEngine) -> bool:
            if some_blocks_in(c) and producer.core.kv_connector is not None:
                producer.core.close_kv_transfer()  # its sockets are gone: nothing more comes
            return some_blocks_in(c)

        tokens = decode(consumer, PROMPTS[2], remote, port, producer, until=dies)
        assert tokens == want[2]
        stats = consumer.core.scheduler.stats()
        assert stats.kv_transfer_failures == 1 and 2 <= stats.kv_transfer_blocks_received < len(PROMPTS[2]) // BLOCK
        assert all_free(consumer)
    finally:
        producer.core.shutdown()
        consumer.core.shutdown()


def test_consumer_gone_mid_transfer_producer_frees_its_blocks(llama_dir: str) -> None:
    port = free_port()
    producer = engine(llama_dir, "kv_producer", port, blocks_per_step=1)
    consumer = engine(llama_dir, "kv_consumer", free_port())
    try:
        remote, _ = prefill(producer, PROMPTS[1])
        params = KVTransferParams(do_remote_prefill=True, remote_host="127.0.0.1", remote_port=port,
                                  remote_request_id=remote)
        consumer.add_request("gone", {"prompt_token_ids": PROMPTS[1]}, greedy(), kv=KVSharing(transfer=params))
        deadline = time.monotonic() + 30
        while consumer.core.scheduler.stats().kv_transfer_blocks_received < 1:
            assert time.monotonic() < deadline
            consumer.step()
            producer.step()
        consumer.core.close_kv_transfer()  # the consumer dies with the transfer half done
        while not all_free(producer):
            assert time.monotonic() < deadline, "the producer keeps the blocks"
            producer.step()
        assert producer.core.scheduler.stats().kv_transfer_bytes_sent > 0
    finally:
        producer.core.shutdown()
        consumer.core.shutdown()


def test_refused_transfer_is_computed_here(pair: Any, want: list[list[int]]) -> None:
    # an id the producer does not hold (expired, or never made): it says so, and the consumer computes
    producer, consumer, port = pair
    before = consumer.core.scheduler.stats().kv_transfer_failures
    assert decode(consumer, PROMPTS[0], "no-such-transfer", port, producer) == want[0]
    assert consumer.core.scheduler.stats().kv_transfer_failures == before + 1
    assert all_free(consumer) and all_free(producer)


@pytest.mark.parametrize("config, message", [
    ('{"kv_role": "kv_producer"', "not valid JSON"),
    ('["kv_producer"]', "must be a JSON object"),
    ({"kv_role": "kv_prefill"}, "kv_role must be one of"),
    ({"kv_role": "kv_both", "kv_connector": "NoSuchConnector"}, "unknown"),
    ({"kv_role": "kv_both", "kv_connector": "LMCacheConnectorV1"}, "'lmcache' package, which is not installed"),
    ({"kv_role": "kv_both", "kv_connector": "MooncakeConnector"}, "'mooncake' package, which is not installed"),
    ({"kv_role": "kv_both", "kv_port": 70000}, "kv_port must be a TCP port"),
    ({"kv_role": "kv_both", "kv_colour": 1}, "unknown field"),
    ({"kv_role": "kv_both", "kv_connector_extra_config": {"hold_s": 1}}, "key 'hold_s' unknown"),
])
def test_bad_config_is_one_clear_error(llama_dir: str, config: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=llama_dir, kv_transfer_config=config).create_engine_config()


def test_port_in_use_is_a_clear_error(pair: Any, llama_dir: str) -> None:
    _, _, port = pair
    with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
        engine(llama_dir, "kv_producer", port)


def test_roles_are_checked_per_request(pair: Any) -> None:
    producer, consumer, _ = pair
    with pytest.raises(ValueError, match="not a KV producer"):
        consumer.add_request("x", {"prompt_token_ids": PROMPTS[0]}, greedy(),
                             kv=KVSharing(transfer=KVTransferParams(do_remote_decode=True)))
    with pytest.raises(ValueError, match="not a KV consumer"):
        producer.add_request("y", {"prompt_token_ids": PROMPTS[0]}, greedy(),
                             kv=KVSharing(transfer=KVTransferParams(do_remote_prefill=True)))
    assert all_free(producer) and all_free(consumer)


def test_other_block_layout_is_refused_and_computed_here(pair: Any, llama_dir: str, want: list[list[int]]) -> None:
    producer, _, port = pair
    consumer = engine(llama_dir, "kv_consumer", free_port(), block_size=2 * BLOCK)
    try:
        remote, _ = prefill(producer, PROMPTS[1])
        assert decode(consumer, PROMPTS[1], remote, port, producer) == want[1]
        assert consumer.core.scheduler.stats().kv_transfer_failures == 1
        assert all_free(consumer) and all_free(producer)  # the producer freed the refused transfer's blocks
    finally:
        consumer.core.shutdown()


def test_a_request_aborted_while_pulling_leaves_nothing(pair: Any) -> None:
    producer, consumer, port = pair
    remote, _ = prefill(producer, PROMPTS[2])
    params = KVTransferParams(do_remote_prefill=True, remote_host="127.0.0.1", remote_port=port,
                              remote_request_id=remote)
    consumer.add_request("aborted", {"prompt_token_ids": PROMPTS[2]}, greedy(), kv=KVSharing(transfer=params))
    consumer.step()  # its blocks are allocated and the pull is sent
    assert consumer.core.scheduler.transfer is not None and consumer.core.scheduler.transfer.pulls
    consumer.abort_request(["aborted"])
    deadline = time.monotonic() + 30
    while not (all_free(consumer) and all_free(producer)):
        assert time.monotonic() < deadline
        producer.step()
        consumer.step()


def test_llm_takes_the_config(llama_dir: str) -> None:
    from tokenmill import LLM

    llm = LLM(llama_dir, dtype="float32", block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, max_model_len=128,
              kv_transfer_config={"kv_role": "kv_both", "kv_port": free_port()})
    try:
        assert llm.engine.core.kv_connector is not None
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], greedy(), use_tqdm=False)  # no transfer: local
        assert out[0].outputs[0].token_ids == hf_expected(llama_dir, PROMPTS[:1], [MAX_TOKENS])[0]
    finally:
        llm.engine.core.shutdown()


def test_other_requests_run_while_blocks_are_awaited(pair: Any, want: list[list[int]]) -> None:
    producer, consumer, port = pair
    remote, first = prefill(producer, PROMPTS[0])
    consumer.add_request("local", {"prompt_token_ids": PROMPTS[1]}, greedy())
    params = KVTransferParams(do_remote_prefill=True, remote_host="127.0.0.1", remote_port=port,
                              remote_request_id=remote)
    consumer.add_request("pulled", {"prompt_token_ids": PROMPTS[0]}, greedy(), kv=KVSharing(transfer=params))
    tokens: dict[str, list[int]] = {"local": [], "pulled": []}
    deadline = time.monotonic() + 60
    while not tokens["local"] or len(tokens["local"]) < MAX_TOKENS:  # the producer is not stepped: no block comes
        assert time.monotonic() < deadline
        for out in consumer.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    assert tokens["local"] == want[1] and tokens["pulled"] == []  # it ran to the end; the other waited
    assert consumer.core.scheduler.transfer is not None and consumer.core.scheduler.transfer.is_pulling("pulled")
    while consumer.has_unfinished_requests():
        assert time.monotonic() < deadline
        producer.step()
        for out in consumer.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    assert tokens["pulled"] == want[0] and tokens["pulled"][:1] == first
    assert all_free(producer) and all_free(consumer)
