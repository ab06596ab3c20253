"""The second KV tier through the whole engine: prefix blocks evicted from a tiny first tier are loaded back
from host memory or disk, a warm restart finds the disk's blocks, damaged disk blocks are recomputed, and
swap preemption resumes requests where they were; greedy tokens equal transformers' throughout."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.conftest import random_prompts
from tests.fixtures import hf_expected
from tokenmill import LLM, SamplingParams
from tokenmill.core.kv_disk_tier import SUFFIX
from tokenmill.core.messages import SchedulerStats

BLOCK = 8
NUM_BLOCKS = 12  # 96 tokens: one conversation's prefix fits, the next ones evict it
# three conversations of 40-token prefixes, each asked twice with different tails; max_model_len 96
PREFIXES = random_prompts(3, 40, 40, seed=11)
TAILS = random_prompts(6, 2, 9, seed=12)
MAX_TOKENS = 6


def tiered(model_dir: str, **kw: Any) -> LLM:
    return LLM(model_dir, dtype="float32", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK, max_model_len=96,
               max_num_seqs=2, **kw)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def conversations() -> list[list[int]]:
    """Each prefix with a first tail, then each with a second: by the second round every prefix has been
    evicted from the first tier by the other two."""
    first = [p + TAILS[i] for i, p in enumerate(PREFIXES)]
    second = [p + TAILS[3 + i] for i, p in enumerate(PREFIXES)]
    return first + second


def run_one_by_one(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [llm.generate([p], greedy(), use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def stats(llm: LLM) -> SchedulerStats:
    return llm.engine.core.scheduler.stats()


def assert_all_free(llm: LLM) -> None:
    core = llm.engine.core
    assert not core.has_unfinished_requests()
    assert core.scheduler.kv.num_free_blocks == core.num_blocks


def disk_files(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(SUFFIX)]


def flush(llm: LLM) -> None:
    tiers = llm.engine.core.scheduler.tiers
    assert tiers is not None and tiers.store.disk is not None
    tiers.store.disk.flush()


@pytest.fixture(scope="module")
def want(llama_dir: str) -> list[list[int]]:
    return hf_expected(llama_dir, conversations(), [MAX_TOKENS] * 6)


@pytest.mark.parametrize("name, tier", [("llama-gqa2-tied", "memory"), ("mistral-window", "memory"),
                                        ("gemma3-local-global", "disk"), ("deepseek-v2-mla", "disk")])
def test_tier_hits_equal_transformers(model_dirs: dict[str, str], name: str, tier: str, tmp_path: Any) -> None:
    # windows, groups of layers with their own windows, a latent (MLA) cache: every group's bytes move, and
    # the disk tier's length check holds them to the cache's bytes per block
    model_dir = model_dirs[name]
    args: dict[str, Any] = (dict(kv_offload_memory="4MiB") if tier == "memory"
                            else dict(kv_offload_disk=str(tmp_path), kv_offload_disk_size="16MiB"))
    llm = tiered(model_dir, **args)
    assert run_one_by_one(llm, conversations()) == hf_expected(model_dir, conversations(), [MAX_TOKENS] * 6)
    s = stats(llm)
    hits = {"memory": s.kv_offload_memory_hits, "disk": s.kv_offload_disk_hits}
    # the prompts share nothing but the prefixes: in the second round each 40-token prefix (5 blocks) is
    # found whole, in the first tier where it kept a block and in the second tier after that
    assert s.prefix_cache_hits + hits[tier] == 3 * 5 * BLOCK
    assert hits[tier] >= 3 * 3 * BLOCK and sum(hits.values()) == hits[tier]
    assert s.kv_offload_bytes_loaded > 0 and s.kv_offload_bytes_offloaded > 0 and s.kv_offload_corrupt_blocks == 0
    assert_all_free(llm)


def test_quantized_cache_blocks_move_with_their_scales(llama_dir: str, tmp_path: Any) -> None:
    plain = tiered(llama_dir, kv_cache_dtype="int8")
    with_tier = tiered(llama_dir, kv_cache_dtype="int8", kv_offload_disk=str(tmp_path), kv_offload_disk_size="4MiB")
    assert run_one_by_one(with_tier, conversations()) == run_one_by_one(plain, conversations())
    assert stats(with_tier).kv_offload_disk_hits >= 3 * 3 * BLOCK


def test_without_tiers_the_same_prompts_recompute(llama_dir: str, want: list[list[int]]) -> None:
    llm = tiered(llama_dir)
    assert run_one_by_one(llm, conversations()) == want
    assert llm.engine.core.scheduler.tiers is None
    assert stats(llm).kv_offload_memory_hits == 0


def test_disk_tier_hits_bounded_and_warm_restart(llama_dir: str, want: list[list[int]], tmp_path: Any) -> None:
    size = 40 * 4200  # about 40 blocks of 4 KiB, with their headers: the bound bites
    args = dict(kv_offload_disk=str(tmp_path), kv_offload_disk_size=size)
    llm = tiered(llama_dir, **args)
    # the writes are asynchronous: a block still queued for the writer is found there
    assert run_one_by_one(llm, conversations()) == want
    s = stats(llm)
    assert s.prefix_cache_hits + s.kv_offload_disk_hits == 3 * 5 * BLOCK
    assert s.kv_offload_disk_hits >= 3 * 3 * BLOCK
    more = random_prompts(8, 60, 80, seed=13)  # 64 more blocks offered to a disk tier of about 40
    run_one_by_one(llm, more)
    flush(llm)
    files = disk_files(str(tmp_path))
    assert files and sum(os.path.getsize(f) for f in files) <= size
    assert_all_free(llm)
    llm.engine.core.shutdown()

    warm = tiered(llama_dir, **args)  # a new engine on the same directory finds the blocks still there
    # more[4:6] were evicted from the first tier by the three after them, so their blocks are among the
    # ~40 the disk kept last
    assert run_one_by_one(warm, more[4:6]) == hf_expected(llama_dir, more[4:6], [MAX_TOKENS] * 2)
    assert stats(warm).kv_offload_disk_hits >= 2 * 7 * BLOCK  # 60+ tokens: 7 blocks each
    assert stats(warm).kv_offload_corrupt_blocks == 0


def test_damaged_disk_blocks_are_recomputed(llama_dir: str, want: list[list[int]], tmp_path: Any) -> None:
    args = dict(kv_offload_disk=str(tmp_path), kv_offload_disk_size="16MiB")
    llm = tiered(llama_dir, **args)
    run_one_by_one(llm, conversations()[:3] + random_prompts(2, 80, 90, seed=14))
    flush(llm)
    llm.engine.core.shutdown()
    files = sorted(disk_files(str(tmp_path)))
    assert len(files) >= 15  # the three prefixes' 5 blocks each at least
    for i, path in enumerate(files):
        with open(path, "r+b") as f:
            if i % 2:
                f.truncate(os.path.getsize(path) - 3)  # truncated
            else:
                f.seek(os.path.getsize(path) // 2)  # one byte of the KV flipped: the checksum catches it
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0x40]))

    damaged = tiered(llama_dir, **args)
    assert run_one_by_one(damaged, conversations()[3:]) == want[3:]
    s = stats(damaged)
    assert s.kv_offload_corrupt_blocks >= 3 and s.kv_offload_disk_hits == 0
    assert_all_free(damaged)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_swap_preemption_resumes_exactly(llama_dir: str, async_scheduling: bool) -> None:
    prompts = random_prompts(9, 3, 60, seed=1)
    max_tokens = [7, 30, 12, 25, 3, 18, 30, 9, 21]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    # 12 blocks of 8 tokens: max_model_len 96 fits, the batch does not
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=12, block_size=8, max_model_len=96,
              preemption_mode="swap", kv_offload_memory="1MiB", async_scheduling=async_scheduling)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_expected(llama_dir, prompts, max_tokens)
    s = stats(llm)
    # a request preempted while the step in flight samples its last token ends without coming back
    assert s.num_preemptions > 0 and 0 < s.num_swapped_in <= s.num_swapped_out
    assert_all_free(llm)
    tiers = llm.engine.core.scheduler.tiers
    assert tiers is not None and tiers.store.swap_reserved_bytes == 0


def test_swap_without_room_recomputes(llama_dir: str) -> None:
    prompts = random_prompts(9, 30, 60, seed=1)
    max_tokens = [7, 30, 12, 25, 3, 18, 30, 9, 21]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    # a memory tier of 3 blocks (4 KiB each): a preempted request of 4 blocks or more does not fit
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=12, block_size=8, max_model_len=96,
              preemption_mode="swap", kv_offload_memory=3 * 4096)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_expected(llama_dir, prompts, max_tokens)
    s = stats(llm)
    assert s.num_preemptions > s.num_swapped_out
    assert_all_free(llm)


@pytest.mark.parametrize("kwargs, words", [
    (dict(kv_offload_memory="lots"), "kv_offload_memory 'lots'"),
    (dict(kv_offload_memory="0GiB"), "kv_offload_memory must be positive"),
    (dict(kv_offload_disk_size="1GiB"), "go together"),
    (dict(kv_offload_disk="/tmp/x"), "go together"),
    (dict(kv_offload_disk="/proc/tokenmill-kv", kv_offload_disk_size="1GiB"), "cannot be made a directory"),
    (dict(kv_offload_disk="/tmp/x", kv_offload_disk_size="0.5"), "kv_offload_disk_size must be a positive size"),
    (dict(preemption_mode="swap"), "give kv_offload_memory"),
    (dict(preemption_mode="evict"), "preemption_mode must be recompute or swap"),
])
def test_bad_flags_are_refused(llama_dir: str, kwargs: dict[str, Any], words: str) -> None:
    from tokenmill.config import EngineArgs

    with pytest.raises(ValueError, match=words):
        EngineArgs(llama_dir, **kwargs).create_engine_config()


def test_a_tier_that_holds_no_block_is_refused(llama_dir: str) -> None:
    with pytest.raises(ValueError, match="holds no KV block"):
        tiered(llama_dir, kv_offload_memory="100B")
