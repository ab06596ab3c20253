"""The engine core's step counters (core.messages.StepStats): for every step, its batch composition
(prompt vs output tokens), the bytes and FLOPs it needs (metrics/step_cost.py) and its wall time while
the engine is busy. Arithmetic on integers per scheduled request; nothing kept per step."""

from __future__ import annotations

import time
from collections.abc import Mapping

from tokenmill.core.messages import StepStats
from tokenmill.core.request import Request
from tokenmill.core.sched_output import SchedulerOutput
from tokenmill.metrics.step_cost import attended_positions, step_bytes, step_flops
from tokenmill.model_math import ModelCost


class StepMeter:
    def __init__(self, cost: ModelCost) -> None:
        self.cost = cost
        self.stats = StepStats()
        # id(SchedulerOutput) -> (scheduling began, prefill tokens, decode tokens, bytes, flops)
        self._pending: dict[int, tuple[float, int, int, float, float]] = {}
        self._last_end = 0.0

    def scheduled(self, so: SchedulerOutput, requests: Mapping[str, Request], began: float) -> None:
        """Count a step just scheduled (the scheduler has advanced num_computed_tokens past it)."""
        if so.is_empty:
            return
        prefill = kv = sampled = attended = 0
        for rid, n in so.num_scheduled_tokens.items():
            req = requests[rid]
            end, prompt = req.num_computed_tokens, req.num_prompt_tokens
            start = end - n
            p = max(0, min(end, prompt) - start)
            prefill += p
            sampled += (n - p) + (1 if p and end >= prompt else 0)
            kv += end
            attended += attended_positions(end, n)
        tokens = so.total_num_scheduled_tokens
        self._pending[id(so)] = (began, prefill, tokens - prefill, step_bytes(self.cost, tokens, kv),
                                 step_flops(self.cost, tokens, sampled, attended))

    def finished(self, so: SchedulerOutput) -> None:
        """A step's outputs are in: its wall time is from when it was scheduled or the previous step
        ended, whichever is later (with async scheduling the steps overlap their scheduling)."""
        entry = self._pending.pop(id(so), None)
        if entry is None:
            return
        now = time.perf_counter()
        began, prefill, decode, nbytes, flops = entry
        dt = now - max(began, self._last_end)
        self._last_end = now
        s = self.stats
        s.steps += 1
        s.busy_s += dt
        s.prefill_tokens += prefill
        s.decode_tokens += decode
        s.bytes += nbytes
        s.flops += flops
        s.last_prefill_tokens, s.last_decode_tokens, s.last_step_s = prefill, decode, dt

    def dropped(self, so: SchedulerOutput) -> None:
        self._pending.pop(id(so), None)

    def snapshot(self) -> StepStats:
        s = self.stats
        return StepStats(s.steps, s.busy_s, s.prefill_tokens, s.decode_tokens, s.bytes, s.flops,
                         s.last_prefill_tokens, s.last_decode_tokens, s.last_step_s)
