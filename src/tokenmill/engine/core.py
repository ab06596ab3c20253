"""The engine core: scheduler + executor, stepping requests until they finish. It speaks
only in typed messages (EngineCoreRequest in, EngineCoreOutputs out), so it can run in
this process or in its own (core_proc)."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future

from tokenmill.config import EngineConfig
from tokenmill.core.kv_offload import kv_layout_fingerprint, kv_offload_store
from tokenmill.core.kv_transfer import KVTransfer
from tokenmill.core.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from tokenmill.core.request import Request
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.input_processor import load_tokenizer
from tokenmill.engine.step_meter import StepMeter
from tokenmill.executor import create_executor
from tokenmill.executor.abstract import Executor, WorkerDied
from tokenmill.kv_transfer import KVConnector, create_connector
from tokenmill.metrics.step_cost import model_cost
from tokenmill.structured.backend import GrammarBackend
from tokenmill.structured.registry import create_grammar_backend

logger = logging.getLogger(__name__)
MAX_FAILED_STEPS = 3  # steps in a row that may fail before the engine core gives up
IDLE_WAIT_S = 0.001  # a step that scheduled nothing while requests wait sleeps this long
KV_WAIT_S = 0.01  # with nothing to run but KV transfers, a step waits this long for their messages


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.config = config
        # the KV transfer connector first: a port in use is refused before the model loads
        self.kv_connector: KVConnector | None = (create_connector(config.kv_transfer)
                                                 if config.kv_transfer is not None else None)
        try:
            self.executor: Executor = executor if executor is not None else create_executor(config)
            try:
                kv_config = self.executor.initialize_kv_cache()
            except BaseException:
                self.executor.shutdown()  # (a multiprocess executor's workers)
                raise
        except BaseException:
            self.close_kv_transfer()
            raise
        num_blocks = kv_config.num_blocks
        capacity = num_blocks * config.cache.block_size
        if capacity < config.model.max_model_len:
            self.close_kv_transfer()
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({num_blocks} blocks), fewer than max_model_len "
                f"({config.model.max_model_len}): raise kv_cache_memory or lower max_model_len"
            )
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks)
        store = kv_offload_store(config, kv_config.bytes_per_block)
        if store is not None:
            self.scheduler.set_kv_offload(store, config.cache.preemption_mode == "swap")
        # grammars for the requests with structured_outputs; the library and the tokenizer load on the first
        self.scheduler.set_structured_output(create_grammar_backend(
            config.structured_outputs, functools.partial(load_tokenizer, config.model.tokenizer),
            config.model.arch.vocab_size, config.model.arch.eos_token_ids,
            fill_on_step_loop=config.device.device == "cpu"))
        self.num_blocks = num_blocks
        self.kv_transfer: KVTransfer | None = None
        if config.kv_transfer is not None:
            tc = config.kv_transfer
            self.kv_transfer = self.scheduler.set_kv_transfer(
                kv_config.bytes_per_block, producer=tc.is_producer, consumer=tc.is_consumer,
                transfer_timeout_s=tc.extra("transfer_timeout_s"), hold_timeout_s=tc.extra("hold_timeout_s"),
                blocks_per_step=int(tc.extra("blocks_per_step")),
                layout=kv_layout_fingerprint(config, kv_config.bytes_per_block))
        self._in_flight: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = deque()
        self._spec_overlap = 0  # steps left to overlap after the proposer's gate chose plain ones (_speculating)
        self._scheduled: dict[str, float] = {}  # first scheduled, not yet reported
        self._failed: list[EngineCoreOutput] = []  # requests of failed steps, not yet reported
        self._failed_steps = 0  # in a row
        self._meter = StepMeter(model_cost(config)) if config.log_stats else None

    def add_request(self, req: EngineCoreRequest) -> None:
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request id {req.request_id!r} is already running")
        transfer = req.kv_transfer
        if transfer is not None:
            role = self.config.kv_transfer
            if transfer.do_remote_decode and (role is None or not role.is_producer):
                raise ValueError("do_remote_decode: this instance is not a KV producer (start it with "
                                 "--kv-transfer-config '{\"kv_role\": \"kv_producer\"}' or kv_both)")
            if transfer.do_remote_prefill and (role is None or not role.is_consumer):
                raise ValueError("do_remote_prefill: this instance is not a KV consumer (start it with "
                                 "--kv-transfer-config '{\"kv_role\": \"kv_consumer\"}' or kv_both)")
        hold = req.hold_kv or (transfer is not None and transfer.do_remote_decode)
        self.scheduler.add_request(Request(req.request_id, req.prompt_token_ids, req.sampling_params,
                                           req.eos_token_ids, req.arrival_time or None, req.priority,
                                           req.priority_class, req.group, hold, req.kv_parent, transfer))

    # ---- KV transfer ----------------------------------------------------------------------
    def pump_kv_transfer(self) -> bool:
        """Take in the KV transfer messages that came, end the transfers past their timeouts, let the requests
        whose blocks are in go on, and send what the scheduler has for other instances; whether anything
        happened (an idle core then reports its stats: held blocks may have been freed)."""
        if self.kv_connector is None or self.kv_transfer is None:
            return False
        messages = self.kv_connector.receive()
        self.kv_transfer.receive(messages)
        expired = self.kv_transfer.expire()
        self.scheduler.finish_pulls()
        self._flush_kv()
        return bool(messages) or expired

    def idle_outputs(self) -> EngineCoreOutputs:
        """No outputs, the stats as they are now."""
        return EngineCoreOutputs([], self._stats(), time.time())

    def _send_kv_blocks(self) -> None:
        """Read out the blocks consumers asked for in a step of their own (no tokens), ahead of the next step
        that computes: a pull waits for the step in flight, not for one more. Run at once where no step is
        in flight, else queued behind them on the worker (its output is taken in order, as any step's)."""
        assert self.kv_transfer is not None
        so = SchedulerOutput([], [], {}, 0, blocks_to_offload=self.kv_transfer.take_sends())
        if self._in_flight:
            try:
                self._in_flight.append((so, self.executor.submit(so)))
            except Exception as e:
                self._failed += self._fail_step(so, e)
            return
        try:
            out = self.executor.execute_model(so)
        except Exception as e:
            self._failed += self._fail_step(so, e)
            return
        self.kv_transfer.sent(so, out)
        self._flush_kv()

    def _flush_kv(self) -> None:
        if self.kv_connector is None or self.kv_transfer is None or not self.kv_transfer.outbox:
            return
        for tid in self.kv_connector.send(self.kv_transfer.take_outbox()):
            self.kv_transfer.peer_gone(tid)

    def kv_pollables(self) -> list[object]:
        return self.kv_connector.pollables() if self.kv_connector is not None else []

    def abort_requests(self, request_ids: Iterable[str]) -> EngineCoreOutputs:
        return EngineCoreOutputs(self.scheduler.abort_requests(request_ids), self._stats(), time.time())

    def step(self) -> EngineCoreOutputs:
        """Run one step and return its outputs. With async scheduling the next step is scheduled, its
        inputs built and queued before this one's outputs are waited for, so the scheduler, the
        input preparation and the caller's output processing run while the steps compute; a step
        is scheduled with the tokens its predecessor samples as placeholders (Scheduler._advance), or
        under pipeline parallelism without the requests whose tokens are in flight, so that two
        pipeline stages run different batches at once. (More steps in flight, one per stage, would also
        need a preempted request held back until every step it was in has run: the scheduler's check
        covers the one step in flight beside the one being scheduled.)

        Speculative decoding needs each step's output before the next is scheduled (its drafts follow
        the tokens taken): while the batch is small enough for proposing (`_speculating`) the steps run
        one at a time (those in flight are drained first); otherwise they overlap and propose nothing,
        and a step that verifies drafts (the first after a switch) is never overlapped, since how many
        tokens it takes is not known when the next would be scheduled."""
        if self.kv_connector is not None:
            if self.scheduler.only_pulling() and not self._in_flight:
                self.kv_connector.wait(KV_WAIT_S)
            self.pump_kv_transfer()
            if self.kv_transfer is not None and self.kv_transfer.has_sends():
                self._send_kv_blocks()
            if self.scheduler.only_pulling() and not self._in_flight:
                return self._outputs(None, None)
        if not self.config.scheduler.async_scheduling or self._speculating():
            if self._in_flight:
                return self._finish_in_flight()
            if not self.scheduler.has_unfinished_requests():
                return self._outputs(None, None)
            so = self._schedule()
            try:
                runner_out = self.executor.execute_model(so)
            except Exception as e:
                return self._step_failed(so, e)
            return self._outputs(so, runner_out)
        if not self._in_flight:
            if not self.scheduler.has_unfinished_requests():
                return self._outputs(None, None)
            self._submit()
        if (len(self._in_flight) < 2 and self.scheduler.has_unfinished_requests()
                and not (self._in_flight and self._in_flight[-1][0].scheduled_spec_decode_tokens)):
            self._submit()
        if not self._in_flight:  # the steps just scheduled failed to be prepared
            return self._outputs(None, None)
        return self._finish_in_flight()

    def _finish_in_flight(self) -> EngineCoreOutputs:
        so, future = self._in_flight.popleft()
        try:
            runner_out = future.result()
        except Exception as e:
            return self._step_failed(so, e)
        return self._outputs(so, runner_out)

    def _speculating(self) -> bool:
        """Whether the workers may propose drafts now: speculative decoding is configured, and the
        adaptive rule is off, or the running batch is within its max_batch_size and the proposer's cost
        gate has not just chosen steps without drafts (ModelRunnerOutput.spec_gated: that many steps are
        overlapped first); or a request brings a Predicted Outputs reference, drafted whatever the batch."""
        spec = self.config.speculative
        if spec is None:
            return False
        if self.scheduler.has_predictions():
            return True
        return not spec.adaptive or (len(self.scheduler.running) <= spec.max_batch_size and not self._spec_overlap)

    def _submit(self) -> None:
        so = self._schedule()
        so.propose_drafts = False  # the next step is scheduled before this one's output is in
        try:
            self._in_flight.append((so, self.executor.submit(so)))
        except Exception as e:
            self._failed += self._fail_step(so, e)

    def _step_failed(self, so: SchedulerOutput, error: Exception) -> EngineCoreOutputs:
        self._failed += self._fail_step(so, error)
        return self._outputs(None, None)

    def _fail_step(self, so: SchedulerOutput, error: Exception) -> list[EngineCoreOutput]:
        """A step that raised ends the requests it scheduled, with the error, and the engine goes on
        with the rest; MAX_FAILED_STEPS failures in a row mean the engine itself is broken, and so
        does a dead worker (WorkerDied: the error ends the engine and with it every request)."""
        if isinstance(error, WorkerDied):
            raise error
        self._failed_steps += 1
        self.scheduler.step_dropped(so)
        if self._meter is not None:
            self._meter.dropped(so)
        logger.error("engine step failed (%d in a row); ending its %d requests", self._failed_steps,
                     len(so.num_scheduled_tokens), exc_info=error)
        if self._failed_steps >= MAX_FAILED_STEPS:
            raise error
        message = f"the engine step failed: {type(error).__name__}: {error}"
        return self.scheduler.fail_requests({rid: message for rid in so.num_scheduled_tokens})

    def _schedule(self) -> SchedulerOutput:
        self._spec_overlap = max(0, self._spec_overlap - 1)
        began = time.perf_counter()
        so = self.scheduler.schedule()
        if self._meter is not None:
            self._meter.scheduled(so, self.scheduler.requests, began)
        if not so.total_num_scheduled_tokens and self.scheduler.waiting:
            time.sleep(IDLE_WAIT_S)  # nothing could run (grammars still compiling): the compile thread gets the CPU
        if so.scheduled_new_reqs:  # a request is new to the workers exactly once: its first schedule
            now = time.time()
            self._scheduled.update((r.req_id, now) for r in so.scheduled_new_reqs)
        return so

    def _outputs(self, so: SchedulerOutput | None, runner_out: ModelRunnerOutput | None) -> EngineCoreOutputs:
        outputs, self._failed = self._failed, []
        if runner_out is not None and runner_out.spec_gated:
            self._spec_overlap = runner_out.spec_gated
        if so is not None and runner_out is not None:
            outputs += self.scheduler.update_from_output(so, runner_out)
            self._failed_steps = 0
            if self._meter is not None:
                self._meter.finished(so)
        self._flush_kv()  # the blocks the step read out for consumers
        scheduled, self._scheduled = self._scheduled, {}
        return EngineCoreOutputs(outputs, self._stats(), time.time(), scheduled)

    def _stats(self) -> SchedulerStats:
        """The scheduler's stats with the step meter's and the grammar backend's counters."""
        stats = self.scheduler.stats()
        if self._meter is not None:
            stats.step = self._meter.snapshot()
        if isinstance(self.scheduler.structured_output, GrammarBackend):
            self.scheduler.structured_output.count_into(stats)
        return stats

    def has_unfinished_requests(self) -> bool:
        return bool(self._in_flight or self._failed) or self.scheduler.has_unfinished_requests()

    def check_health(self) -> None:
        """Raise WorkerDied where a worker is gone (the core process checks while idle too)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Wait for the steps in flight and stop the worker thread (or processes). A step that failed is
        dropped with its error (a dead worker's was raised by the step that met it)."""
        try:
            while self._in_flight:
                with contextlib.suppress(Exception):
                    self._in_flight.popleft()[1].result()
        finally:
            self.executor.shutdown()
        if isinstance(self.scheduler.structured_output, GrammarBackend):
            self.scheduler.structured_output.shutdown()
        self.close_kv_offload()
        self.close_kv_transfer()

    def close_kv_transfer(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.close()
            self.kv_connector = None

    def close_kv_offload(self) -> None:
        """Write the disk tier's queued blocks and stop its thread (a warm restart finds them)."""
        if self.scheduler.tiers is not None:
            self.scheduler.tiers.store.close()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv.reset_prefix_cache()

    def prepare_structured_output(self) -> None:
        """Starts loading the grammar backend's library and tokenizer off the step loop (the front end asks
        when its first constrained request arrives, so both processes load at once)."""
        if isinstance(self.scheduler.structured_output, GrammarBackend):
            self.scheduler.structured_output.prepare()
