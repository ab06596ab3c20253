"""The server's observability options (cli_serve.py: --slo, --bandwidth, --flops, --otlp-traces-endpoint),
applied to the engine's metrics once it is up: the SLO goodput is judged by, the ceilings MBU/MFU divide
by (else the roofline cache), `tokenmill plan`'s figures for the dashboard, and the request tracer."""

from __future__ import annotations

import argparse
import logging

from tokenmill.config import default_num_threads
from tokenmill.engine.async_engine import AsyncLLM
from tokenmill.metrics.ceilings import cached_ceilings
from tokenmill.metrics.slo import SLO
from tokenmill.metrics.step_cost import plan_figures
from tokenmill.metrics.tracing import RequestTracer

logger = logging.getLogger(__name__)


def apply(engine: AsyncLLM, args: argparse.Namespace) -> None:
    config = engine.config
    threads = config.device.num_threads or default_num_threads()
    ceilings, missing = cached_ceilings(config.model.dtype, args.bandwidth, args.flops,
                                        threads if config.device.device == "cpu" else 1, config.device.device)
    if missing:
        logger.warning("no roofline measured for %d threads on this machine: MBU/MFU stay out of /metrics until "
                       "`tokenmill bench roofline --threads %d` (or --bandwidth/--flops)", threads, threads)
    engine.metrics.live.configure(ceilings, SLO.parse(args.slo), plan_figures(config, ceilings))
    if args.otlp_traces_endpoint is not None:
        engine.metrics.tracer = RequestTracer.to_otlp(args.otlp_traces_endpoint, config.model.served_model_name)
