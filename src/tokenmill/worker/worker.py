"""One rank's worker: its device and threads, the model it loads, the KV cache it allocates; the
`ModelRunner` it creates then turns each step's SchedulerOutput into tensors, runs and samples.

Executors call these methods by name (`collective_rpc`), so every public method here is part of the
executor/worker contract."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch

from tokenmill.attention import get_backend
from tokenmill.attention.backend import check_kv_cache_dtype
from tokenmill.config import EngineConfig, default_num_threads
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.distributed import PipelineParallel, TensorParallel, init_parallel
from tokenmill.kernels import load_cpu_kernels
from tokenmill.kv_cache_spec import KVCacheConfig, KVCacheSpec, kv_storage_dtype
from tokenmill.layers import use_cpu_kernels
from tokenmill.layers.linear import LinearMethod, UnquantizedLinearMethod, use_triton_gemv
from tokenmill.layers.quantization import QuantizedLinearMethod
from tokenmill.models.loader import TORCH_DTYPES, load_model
from tokenmill.spec_decode.adaptive import SpecDecoder
from tokenmill.spec_decode.proposer import ProposerContext
from tokenmill.spec_decode.registry import create_proposer
from tokenmill.worker.fused_decode import FusedDecode
from tokenmill.worker.kv_cache import allocate_kv_caches, bind_kv_caches, kv_cache_specs
from tokenmill.worker.memory import keep_freed_memory
from tokenmill.worker.model_runner import ModelRunner, PreparedStep

logger = logging.getLogger(__name__)


class Worker:
    """`rank` of the world of tensor x pipeline parallel ranks, which they join through `distributed_init`
    (a file path or a tcp:// URL for torch.distributed's rendezvous; None for a single rank)."""

    def __init__(self, config: EngineConfig, rank: int = 0, distributed_init: str | None = None) -> None:
        self.config = config
        self.rank = rank
        self.device = torch.device(config.device.device)
        self.dtype = TORCH_DTYPES[config.model.dtype]
        self.model_runner: ModelRunner | None = None
        self.tp = TensorParallel()
        self.pp = PipelineParallel()
        self.init_device(distributed_init)
        self.load_model()
        if self.device.type == "cpu":  # after the load (keep_freed_memory says why)
            keep_freed_memory()

    def init_device(self, distributed_init: str | None = None) -> None:
        parallel = self.config.parallel
        if self.device.type == "cpu":  # each rank its share of the threads
            torch.set_num_threads(parallel.threads_per_rank(self.config.device.num_threads or default_num_threads()))
        if parallel.world_size > 1:
            if distributed_init is None:
                raise ValueError("a worker of several ranks needs its group's rendezvous (distributed_init)")
            self.tp, self.pp = init_parallel(self.rank, parallel.tensor_parallel_size,
                                             parallel.pipeline_parallel_size, distributed_init)
        # every rank the same seed: each last-stage rank samples the same tokens from the same gathered logits
        torch.manual_seed(self.config.model.seed)

    def load_model(self) -> None:
        """The checkpoint into this device's model; on a bf16 CPU with tokenmill's C++ kernels built,
        the linear layers, elementwise layers and attention take them; on a float32 CPU model, the elementwise
        layers."""
        cfg = self.config
        # tokenmill's C++ kernels wherever this worker may use them (a CPU, --cpu-kernels), any dtype; `ops`: the
        # same where the model runs in bf16 (the packed linear layers' GEMV, the fused bf16 layers)
        use_kernels = self.device.type == "cpu" and cfg.device.cpu_kernels
        self.kernels: Any = load_cpu_kernels() if use_kernels else None
        self.ops: Any = self.kernels if self.dtype == torch.bfloat16 else None
        threads = torch.get_num_threads()
        if self.device.type == "cpu" and cfg.parallel.world_size == 1:
            # the load's copies and repacking on every CPU this process may use, not only the compute threads
            torch.set_num_threads(max(threads, default_num_threads()))
        try:
            self.model: Any = load_model(cfg.model.model, cfg.model.arch, self.dtype, self.device,
                                         self._linear_method(), self.tp, self.pp)
        finally:
            torch.set_num_threads(threads)
        self._fuse_elementwise(self.model)
        if self.device.type == "cuda" and cfg.attention_backend == "triton":  # the fused Triton layers, the GEMV
            from tokenmill.kernels.triton.elementwise import TritonOps
            from tokenmill.kernels.triton.gemv import TritonGemv

            use_cpu_kernels(self.model, TritonOps())
            use_triton_gemv(self.model, TritonGemv())
        self.backend = get_backend(cfg.attention_backend)
        self.kv_dtype = kv_storage_dtype(cfg.cache.kv_cache_dtype, cfg.model.dtype)
        check_kv_cache_dtype(self.backend, self.kv_dtype)

    def _fuse_elementwise(self, model: Any) -> None:
        """A model's norms, rotary and SiLU-and-mul through the C++ fused ops on a CPU: bf16 activations with
        the worker's ops, float32 ones (the fused ops take those too) where the model runs in float32."""
        use_cpu_kernels(model, self.ops)
        if self.dtype == torch.float32 and self.kernels is not None:
            use_cpu_kernels(model, self.kernels, dtypes=(torch.float32,))

    def _float_linear_method(self) -> LinearMethod:
        """The unquantized method for this worker's models: on an AVX2 CPU running a bf16 checkpoint in
        float32 (ModelConfig.linear_weight_dtype), weights kept in bf16 and widened by the C++ GEMV."""
        if self.config.model.linear_weight_dtype == "bfloat16":
            if self.kernels is not None and int(self.kernels.bf16w_gemv_max_rows()) > 0:
                return UnquantizedLinearMethod(self.ops, weight_dtype=torch.bfloat16, widen_ops=self.kernels)
            # without the C++ GEMV every decode step would widen every weight: float32 weights run faster
            # (the byte counts of ModelCost still take the weights as bf16)
            logger.warning("the C++ bf16 GEMV is not built here: the linear layers keep float32 weights")
        return UnquantizedLinearMethod(self.ops)

    def _linear_method(self) -> LinearMethod:
        """The checkpoint's quantized method (whose kernels take fp32 too), or the float one."""
        quant = self.config.model.quantization
        if quant is None:
            return self._float_linear_method()
        return QuantizedLinearMethod(quant, self.kernels, self.ops)

    def weight_bytes(self) -> int:
        """Bytes of the loaded model's parameters (a tied tensor once), as they sit in memory."""
        tensors = {id(p): p for p in self.model.parameters()}.values()
        return sum(int(torch.ops.mkldnn._nbytes(p)) if p.is_mkldnn else p.numel() * p.element_size() for p in tensors)

    def stage_layers(self) -> range:
        """The indices of the model's layers this rank's pipeline stage holds."""
        return self.pp.layers(self.config.model.arch.num_layers)

    def stage_times(self) -> dict[str, float]:
        """This rank's StageTimes (summed over the steps so far) as a dict: what a pipeline stage waited for."""
        return dataclasses.asdict(self.runner().stage_times)

    def pid(self) -> int:
        return os.getpid()

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return kv_cache_specs(self.model, self.config.cache.block_size, self.kv_dtype)

    def initialize_kv_cache(self, kv_config: KVCacheConfig | list[KVCacheConfig]) -> None:
        """Allocate the pool `kv_config` plans; a list gives each pipeline stage's plan in stage order (a
        stage's layers are its own; the plans agree on the blocks)."""
        if isinstance(kv_config, list):
            kv_config = kv_config[self.pp.stage]
        caches = allocate_kv_caches(kv_config, self.device)
        bind_kv_caches(self.model, caches, self.backend)
        logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB)", kv_config.num_blocks,
                    kv_config.block_size, kv_config.num_blocks * kv_config.block_size, caches.nbytes / 2**20)
        self.model_runner = ModelRunner(self.config, self.model, self.backend, self.kernels, kv_config, caches,
                                        self.pp)
        self._install_proposer()

    def _install_proposer(self) -> None:
        """The configured speculative method's proposer under the adaptive rule; with none configured and
        async scheduling off, one that drafts only from requests' Predicted Outputs."""
        spec = self.config.speculative
        if spec is None and self.config.scheduler.async_scheduling:
            return
        proposer = None
        if spec is not None:
            ctx = ProposerContext(self.config, self.device, self.ops, FusedDecode.create, self._float_linear_method,
                                  self._fuse_elementwise, self.kernels)
            proposer = create_proposer(spec, ctx)
            logger.info("speculative decoding: %s, up to %d draft tokens a step", spec.method,
                        spec.num_speculative_tokens)
        self.runner().set_proposer(SpecDecoder(spec, proposer))

    def runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise RuntimeError("the worker's KV cache is not initialized yet")
        return self.model_runner

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner().execute_model(so)

    def prepare(self, so: SchedulerOutput) -> PreparedStep | None:
        return self.runner().prepare(so)

    def execute(self, prepared: PreparedStep | None) -> ModelRunnerOutput:
        return self.runner().execute(prepared)
