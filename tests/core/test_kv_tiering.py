"""The scheduler's side of the second KV tier against the fake runner's shadow KV memory (no torch): the
runner reads evicted and swapped blocks out, and writes loaded ones in, as the real runner does; every
step then reads back every earlier position through the block table, so a block loaded into the wrong
place, loaded before its bytes were read out, or read out after something overwrote it fails the step.
Random workloads with prefix sharing, preemption, swap, aborts, sync and async steps: the reference's
tokens, no block leaked, no swap space left reserved."""

from __future__ import annotations

import dataclasses
import tempfile
from array import array

from hypothesis import event, given, settings
from hypothesis import strategies as st

from tokenmill.core.kv_disk_tier import DiskTier
from tokenmill.core.kv_offload import KVOffloadStore
from tokenmill.core.sched_output import ModelRunnerOutput

from .test_async_scheduling import assert_all_free, drive_core, make_core, reference
from .test_scheduler import FakeRunner, PreparedStep, Result, workloads

EMPTY = (-1, -1)


class TieredFakeRunner(FakeRunner):
    """Blocks as bytes: each slot's (position, token), or (-1, -1) where nothing was written."""

    def block_nbytes(self) -> int:
        return 16 * self.block_size

    def read(self, block: int) -> bytes:
        slots = [self.memory.get((block, o), EMPTY) for o in range(self.block_size)]
        return array("q", [v for slot in slots for v in slot]).tobytes()

    def write(self, block: int, payload: bytes) -> None:
        values = array("q", payload).tolist()
        assert len(values) == 2 * self.block_size
        for o in range(self.block_size):
            slot = (values[2 * o], values[2 * o + 1])
            if slot == EMPTY:
                self.memory.pop((block, o), None)
            else:
                self.memory[(block, o)] = slot

    def run(self, step: PreparedStep) -> ModelRunnerOutput:
        so = step.so
        offloaded = [self.read(b.block_id) for b in so.blocks_to_offload]  # before anything writes
        copies = [(src, self.read(src)) for src, _ in so.blocks_to_copy]
        for (_, dst), (_, payload) in zip(so.blocks_to_copy, copies, strict=True):
            self.write(dst, payload)
        for block, payload in so.blocks_to_load:
            self.write(block, payload)
        out = super().run(PreparedStep(dataclasses.replace(so, blocks_to_copy=[]), step.rows))
        out.offloaded_kv = offloaded
        return out


@settings(max_examples=150, deadline=None)
@given(workloads(), st.data())
def test_tiered_workloads_give_the_reference_results_without_leaks(
    workload: tuple[dict[str, int], list[tuple[int, list[int], int, int]]], data: st.DataObject,
) -> None:
    cfg, base = workload
    reqs = [(*r, data.draw(st.booleans()), data.draw(st.none() | st.integers(1, 12))) for r in base]
    async_scheduling, swap, use_disk = data.draw(st.booleans()), data.draw(st.booleans()), data.draw(st.booleans())
    # a memory tier of a few blocks or plenty (swap needs one), a disk tier of 12 blocks, or both
    memory_blocks = data.draw(st.sampled_from([0, 2, 6, 64]))
    if swap and not memory_blocks:
        memory_blocks = 2
    use_disk = use_disk or not memory_blocks
    core, executor = make_core(cfg["num_blocks"], cfg["block_size"], cfg["budget"], cfg["max_num_seqs"],
                               cfg["max_model_len"], async_scheduling)
    runner = TieredFakeRunner(cfg["block_size"], executor.runner.next_token)
    executor.runner = runner
    with tempfile.TemporaryDirectory() as root:
        disk = DiskTier(root, 12 * (runner.block_nbytes() + 200), "fake", runner.block_nbytes()) if use_disk else None
        store = KVOffloadStore(runner.block_nbytes(), memory_blocks * runner.block_nbytes(), disk)
        core.scheduler.set_kv_offload(store, swap)
        results: dict[str, Result] = {}
        aborted = drive_core(core, reqs, results)
        store.close()
    for i, (_, prompt, max_tokens, _, ignore_eos, _) in enumerate(reqs):
        tokens, reason = reference(prompt, max_tokens, cfg["max_model_len"], ignore_eos)
        got = results[f"r{i}"].token_ids
        if f"r{i}" in aborted:
            assert results[f"r{i}"].finish_reason == "abort" and tokens[:len(got)] == got
        else:
            assert (got, results[f"r{i}"].finish_reason) == (tokens, reason)
    assert_all_free(core)
    assert store.swap_reserved_bytes == 0
    stats = core.scheduler.stats()
    event(f"second-tier hits: {stats.kv_offload_memory_hits + stats.kv_offload_disk_hits > 0}")
    event(f"swapped in: {stats.num_swapped_in > 0}")
    core.shutdown()


def test_a_tight_pool_swaps_and_hits_the_second_tier() -> None:
    # 6 blocks of 4 tokens for requests that grow to 22: two admitted at once preempt each other as they
    # grow; their shared 8-token stems are evicted and found again
    stems = [[11] * 8, list(range(30, 38))]
    reqs = [(i // 2, stems[i % 2] + [50 + i, 51], 12, 0, True, None) for i in range(8)]
    for async_scheduling in (False, True):
        core, executor = make_core(6, 4, 40, 4, 24, async_scheduling)
        runner = TieredFakeRunner(4, executor.runner.next_token)
        executor.runner = runner
        store = KVOffloadStore(runner.block_nbytes(), 64 * runner.block_nbytes())
        core.scheduler.set_kv_offload(store, swap=True)
        results: dict[str, Result] = {}
        drive_core(core, reqs, results)
        for i, (_, prompt, max_tokens, _, _, _) in enumerate(reqs):
            assert results[f"r{i}"].token_ids == reference(prompt, max_tokens, 24, True)[0]
        stats = core.scheduler.stats()
        assert stats.num_swapped_in > 0 and stats.kv_offload_memory_hits > 0, (async_scheduling, stats)
        assert_all_free(core)
        assert store.swap_reserved_bytes == 0
        nbytes = runner.block_nbytes()  # the occupancy gauges: what the memory tier holds now
        assert stats.kv_offload_memory_blocks == store.num_memory_blocks > 0
        assert stats.kv_offload_memory_swap_blocks == 0
        assert stats.kv_offload_memory_used_bytes == stats.kv_offload_memory_blocks * nbytes
        assert stats.kv_offload_memory_capacity_bytes == 64 * nbytes and stats.kv_offload_disk_capacity_bytes == 0
