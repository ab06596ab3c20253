"""The engine core in its own process; the API process's side is core_client.CoreClient.

Two ZMQ PUSH/PULL pipes over ipc:// sockets in a private temp dir carry the messages of
wire, typed msgspec Structs in multipart `[kind, msgpack payload]` frames. The core drains its input
without blocking while requests run, steps, and sends outputs; when idle it blocks on
input (waking every second to notice a dead parent). Startup failures come back as a
FAILED message; a core that dies later is noticed through its process sentinel.

SIGTERM stops a core that is still loading; once it serves, the API process owns its end (it
drains its requests, then sends SHUTDOWN), so a SIGTERM to the whole process group (systemd's
default, `kill -TERM -PGID`) does not cut the requests the API process is draining. A core whose API
process is gone exits by itself within a second.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from typing import Any

import msgspec
import zmq

from tokenmill.config import EngineArgs
from tokenmill.core.messages import EngineCoreOutput, EngineCoreOutputs
from tokenmill.engine.wire import (
    ABORT,
    ADD,
    FAILED,
    OUTPUTS,
    READY,
    SHUTDOWN,
    UTILITY,
    UTILITY_METHODS,
    UTILITY_RESULT,
    CoreFailed,
    CoreReady,
    UtilityCall,
    UtilityResult,
    decode,
    decode_request,
    encode,
    request_id_of,
)
from tokenmill.fast_exit import fast_exit

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 1000


def run_engine_core(args: EngineArgs, input_addr: str, output_addr: str, log_level: str) -> None:
    """Entry point of the core process (spawned). It validates the config itself, so it can
    start before the API process has imported torch and transformers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process owns Ctrl-C and shuts us down
    signal.signal(signal.SIGTERM, _exit_on_signal)
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s [core]: %(message)s")
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    out.connect(output_addr)
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    start = time.perf_counter()
    try:
        from tokenmill.engine.core import EngineCore

        core = EngineCore(args.create_engine_config())
    except Exception as e:  # any load failure must reach the launcher as a message
        message = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        out.send_multipart([FAILED, encode(CoreFailed(message))])
        out.close()
        ctx.term()
        raise SystemExit(1) from None
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # serving: the API process stops us (module docstring)
    out.send_multipart([READY, encode(CoreReady(os.getpid(), core.num_blocks, time.perf_counter() - start))])
    code = 0
    try:
        CoreLoop(core, inp, out).run()
    except Exception as e:
        logger.error("engine core failed:\n%s", traceback.format_exc())
        out.send_multipart([FAILED, encode(CoreFailed(f"{type(e).__name__}: {e}"))])
        code = 1
    finally:
        inp.close(linger=0)
        out.close()
        ctx.term()
        core.close_kv_offload()
        core.close_kv_transfer()
    fast_exit(code)


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(0)


class CoreLoop:
    def __init__(self, core: Any, inp: zmq.Socket[bytes], out: zmq.Socket[bytes]) -> None:
        self.core = core
        self.inp = inp
        self.out = out
        self.parent_pid = os.getppid()
        self.stopping = False

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inp, zmq.POLLIN)
        kv_sockets = self.core.kv_pollables()  # a KV producer's socket: a consumer's pull wakes the loop
        for sock in kv_sockets:
            poller.register(sock, zmq.POLLIN)
        last_check = time.monotonic()
        while not self.stopping:
            busy = self.core.has_unfinished_requests()
            events = dict(poller.poll(0 if busy else _IDLE_POLL_MS))
            if self.inp in events:
                self._drain()
            if kv_sockets and not busy and self.core.pump_kv_transfer():  # (a busy core pumps in its step)
                self._send(self.core.idle_outputs())
            if time.monotonic() - last_check > 1.0:
                last_check = time.monotonic()
                if os.getppid() != self.parent_pid:
                    logger.warning("the API process is gone; the engine core exits")
                    return
                self.core.check_health()  # a dead worker ends the core (FAILED), even while idle
            if not self.stopping and self.core.has_unfinished_requests():
                self._step()

    def _drain(self) -> None:
        while True:
            try:
                frames = self.inp.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            kind, msg = decode(frames)
            if kind == ADD:
                for raw in msg:
                    self._add(raw)
            elif kind == ABORT:
                self._send(self.core.abort_requests(msg.request_ids))
            elif kind == UTILITY:
                self._utility(msg)
            elif kind == SHUTDOWN:
                self.stopping = True
                return

    def _add(self, raw: msgspec.Raw) -> None:
        """Add one request; one the core cannot take ends at once with the error (the front end waits
        for its outputs), and never ends the core."""
        request_id = request_id_of(raw)
        try:
            self.core.add_request(decode_request(raw))
        except Exception as e:
            logger.error("rejected request %s: %s", request_id, e)
            if request_id is not None:
                output = EngineCoreOutput(request_id, [], finish_reason="error", stop_reason=str(e))
                self._send(EngineCoreOutputs([output], None, time.time()))

    def _utility(self, call: UtilityCall) -> None:
        if call.method not in UTILITY_METHODS:
            result = UtilityResult(call.call_id, error=f"unknown utility method {call.method!r}")
        else:
            try:
                result = UtilityResult(call.call_id, getattr(self.core, call.method)())
            except Exception as e:  # a failed utility call is the caller's error, not the core's end
                result = UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}")
        self.out.send_multipart([UTILITY_RESULT, encode(result)])

    def _step(self) -> None:
        self._send(self.core.step())

    def _send(self, outputs: EngineCoreOutputs) -> None:
        self.out.send_multipart([OUTPUTS, encode(outputs)], copy=False)
