"""Engine configuration: one flat `EngineArgs` (CLI and Python API) validated once into frozen
per-area configs. After `EngineArgs.create_engine_config()` every component trusts its config.

This module imports no torch, so the pure-Python core can use these types.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.util
import json
import logging
import os
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import psutil

from tokenmill.arch import RUNNERS, ArchConfig, load_arch_config
from tokenmill.cpu_features import cpu_runs_bf16
from tokenmill.json_arg import json_object
from tokenmill.kv_cache_spec import KV_CACHE_DTYPE_CHOICES, kv_storage_dtype
from tokenmill.kv_transfer_config import KVTransferConfig, resolve_kv_transfer_config
from tokenmill.parallel_config import DISTRIBUTED_EXECUTOR_BACKENDS, ParallelConfig, resolve_parallel_config
from tokenmill.pooling import PoolerConfig, checkpoint_max_seq_length, resolve_pooler_config
from tokenmill.quantization_config import QUANTIZATION_METHODS, QuantConfig, resolve_quantization
from tokenmill.structured_outputs_config import StructuredOutputsConfig, resolve_structured_outputs_config

logger = logging.getLogger(__name__)
DTYPES = ("auto", "bfloat16", "float16", "float32")
_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30}
DEFAULT_KV_CACHE_BYTES = 4 * 2**30
PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class ModelConfig:
    model: str
    tokenizer: str
    dtype: str  # resolved: bfloat16 | float16 | float32
    max_model_len: int
    seed: int
    arch: ArchConfig
    served_model_name: str
    quantization: QuantConfig | None = None  # the weights' (None: float)
    runner: str = "generate"  # generate | pooling (embeddings: worker/pooling_runner.py)
    pooler: PoolerConfig | None = None  # set for the pooling runner
    # bfloat16: the linear layers keep the checkpoint's bf16 weights where the model runs in float32 because
    # this CPU has no bf16 arithmetic (an AVX2 CPU, dtype auto); float32 products over them (bf16 widens exactly)
    linear_weight_dtype: str | None = None


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    kv_cache_bytes: int
    num_kv_blocks: int | None  # explicit pool size (tests, tuning); overrides kv_cache_bytes
    enable_prefix_caching: bool
    kv_cache_dtype: str = "auto"  # a KV_CACHE_DTYPE_CHOICES name (kv_cache_spec.kv_storage_dtype stores it)
    # the second KV tier (core/kv_offload.py): host memory and a directory on disk, each 0 / None when off
    kv_offload_memory_bytes: int = 0
    kv_offload_disk: str | None = None
    kv_offload_disk_bytes: int = 0
    preemption_mode: str = "recompute"  # recompute | swap (into the memory tier)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # schedule step N+1 while step N runs (the engine core keeps up to two steps in flight)
    async_scheduling: bool = False
    # while requests of a higher priority class are in the engine, the prompt tokens a step that the requests
    # of lower classes (Batch API lines) get together on average (their decode rows are not counted)
    lower_class_step_tokens: int = 32
    # whether a request whose sampled token is still in flight may be scheduled again (the token a
    # placeholder the workers fill in); False under pipeline parallelism, where the steps in flight then
    # hold different requests and the first stage never waits for a token the last has not sampled
    schedule_tokens_in_flight: bool = True


@dataclass(frozen=True)
class DeviceConfig:
    device: str  # cpu | cuda
    num_threads: int | None
    cpu_kernels: bool  # tokenmill's C++ kernels (decode attention, fused bf16 ops) on CPU
    enforce_eager: bool = False  # on a GPU: no CUDA graphs for decode steps



def bf16_weights_kept(arch: ArchConfig) -> bool:
    """Whether a float32 model of this checkpoint may keep its linear weights in bf16 (ModelConfig.linear_weight_dtype):
    a bf16 checkpoint of a model without MLA (dense, or with routed experts: their projections are linear layers
    too; MLA's absorbed decode multiplies its kv_b weight outside them)."""
    return arch.dtype == "bfloat16" and arch.mla is None

@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: DeviceConfig
    attention_backend: str
    speculative: SpeculativeConfig | None = None  # speculative decoding, off when None
    log_stats: bool = True  # the engine core's step counters (core.messages.StepStats) and the step metrics
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # tensor and pipeline parallelism, the executor
    kv_transfer: KVTransferConfig | None = None  # disaggregated prefill/decode (kv_transfer_config.py), off when None
    # the grammar backend of requests with structured outputs and its options (structured_outputs_config.py)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)


# speculative decoding's methods; spec_decode/registry.py maps each to its proposer's factory
SPECULATIVE_METHODS = ("ngram", "draft_model", "lookahead", "medusa")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config: the proposer `method`, `num_speculative_tokens` (k, the most drafts a
    step verifies per request), the draft checkpoint (`model`: draft_model's smaller model, medusa's
    heads), prompt lookup's n-gram lengths, lookahead's pool, and the adaptive rule's bounds."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    lookahead_ngram: int = 4  # lookahead: the length of the n-grams its pool keeps (key of n - 1, then k)
    lookahead_pool_size: int = 64  # lookahead: continuations kept per key
    draft_kv_cache_memory: int = 256 * 2**20  # draft_model: bytes of the draft's own KV cache
    # draft_model: how the draft's weights are quantized, as --quantization says it for the target (int8 / int4 /
    # w8a8 round a float draft at load); None: as the draft checkpoint's quantization_config says (float if none)
    quantization: str | None = None
    # adaptive: proposing stops for the step when the batch has more running requests than this ...
    max_batch_size: int = 32
    # ... and a request's k shrinks to what its acceptance (decayed accepted / checked drafts) pays for, at the
    # batch size and the proposer's measured cost
    adaptive: bool = True

    @classmethod
    def create(cls, raw: dict[str, Any] | None, target: ModelConfig) -> SpeculativeConfig | None:
        """Validated once at start-up: one ValueError that says what to change."""
        if raw is None:
            return None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: {sorted(known)}")
        method = raw.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method {method!r} unknown; choose from {list(SPECULATIVE_METHODS)}")
        k = raw.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k <= 0:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}")
        try:
            spec = cls(**raw)
        except TypeError as e:
            raise ValueError(f"speculative_config: {e}") from None
        for name in ("prompt_lookup_min", "prompt_lookup_max", "lookahead_pool_size", "draft_kv_cache_memory"):
            if not isinstance(getattr(spec, name), int) or getattr(spec, name) < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {getattr(spec, name)!r}")
        if spec.prompt_lookup_min > spec.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({spec.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({spec.prompt_lookup_max})")
        if not isinstance(spec.lookahead_ngram, int) or spec.lookahead_ngram < 2:
            raise ValueError(f"speculative_config: lookahead_ngram must be >= 2, got {spec.lookahead_ngram!r}")
        if spec.method in ("draft_model", "medusa") and not spec.model:
            raise ValueError(f"speculative_config: method {method!r} needs \"model\" (the "
                             f"{'draft checkpoint' if method == 'draft_model' else 'Medusa heads'} directory)")
        if spec.quantization is not None and spec.method != "draft_model":
            raise ValueError(f"speculative_config: quantization applies to a draft model's weights, not to method "
                             f"{spec.method!r}")
        if spec.method == "draft_model":
            assert spec.model is not None
            _check_draft(spec.model, target)
            try:
                spec.draft_quantization()
            except ValueError as e:
                raise ValueError(f"speculative_config: the draft model: {e}") from None
        return spec

    def draft_quantization(self) -> QuantConfig | None:
        """The draft model's quantization (`quantization`, else its checkpoint's), None for a float draft."""
        assert self.model is not None
        return resolve_quantization(self.model, self.quantization)


def _check_draft(draft_dir: str, target: ModelConfig) -> None:
    """A draft must share the target's vocabulary and tokenizer and be smaller than it."""
    try:
        draft = load_arch_config(draft_dir)
    except (OSError, ValueError) as e:
        raise ValueError(f"speculative_config: the draft model {draft_dir!r} cannot be read: {e}") from None
    if draft.vocab_size != target.arch.vocab_size:
        raise ValueError(f"speculative_config: the draft's vocabulary ({draft.vocab_size} tokens) is not the "
                         f"target's ({target.arch.vocab_size}); a draft must use the target's tokenizer")
    if _tokenizer_vocab(draft_dir) != _tokenizer_vocab(target.tokenizer):
        raise ValueError(f"speculative_config: the draft {draft_dir!r} has another tokenizer than the target; "
                         "a draft must use the target's tokenizer")
    if _num_params(draft) >= _num_params(target.arch):
        raise ValueError(f"speculative_config: the draft ({_num_params(draft):,} parameters) is not smaller than "
                         f"the target ({_num_params(target.arch):,}); choose a smaller draft model")


def _tokenizer_vocab(directory: str) -> Any:
    """The tokenizer's vocabulary as tokenizer.json has it, None where the directory has none."""
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f).get("model", {}).get("vocab")


def _num_params(arch: ArchConfig) -> int:
    """The weights of a decoder of this shape (embeddings, attention, MLP; norms left out)."""
    attn = arch.hidden_size * arch.head_dim * (2 * arch.num_heads + 2 * arch.num_kv_heads)
    mlp = 3 * arch.hidden_size * arch.intermediate_size
    embed = arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
    return arch.num_layers * (attn + mlp) + embed


def parse_memory(value: str | int | float, name: str = "kv_cache_memory") -> int | float:
    """'4GiB' / '512MB' / 1073741824 -> bytes (int); '0.3' / 0.3 -> fraction of free RAM (float)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{name} {value!r} is not a size like '4GiB', '512MB', or a fraction like 0.3")
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit == "" and number <= 1:
        return number
    return int(number * _UNITS[unit])


def _arg(default: Any, doc: str) -> Any:
    """An EngineArgs field with a default; `doc` is its --help text."""
    return field(default=default, metadata={"help": doc})


@dataclass
class EngineArgs:
    """Everything a user can set; each field's metadata["help"] is its CLI help."""

    model: str = field(metadata={"help": "a Hugging Face checkpoint directory (config.json, *.safetensors)"})
    tokenizer: str | None = _arg(None, "the tokenizer's directory (default: the model's)")
    served_model_name: str | None = _arg(None, "the model name the OpenAI API reports and accepts, besides the "
                                               "model path (default: the model path)")
    dtype: str = _arg("auto", "weight and activation dtype; auto: the checkpoint's (float16 runs as bfloat16 on "
                              "a CPU)")
    max_model_len: int | None = _arg(None, "the most tokens a sequence holds, prompt and output together "
                                           "(default: the model's max_position_embeddings)")
    seed: int = _arg(0, "seed of the engine's random generator, which samples the requests that bring no seed")
    block_size: int | None = _arg(None, "tokens per KV-cache block (default: 32 on a CPU, 16 on a GPU); "
                                        "prefix-cache hits come in whole blocks")
    kv_cache_memory: str | int | float | None = _arg(
        None, "KV-cache size: bytes ('4GiB', '512MB') or a fraction of available memory (0.3), all "
              "ranks' together (default: 4 GiB or 0.3 of available memory, whichever is less)")
    num_kv_blocks: int | None = _arg(None, "KV-cache size in blocks; overrides --kv-cache-memory")
    kv_cache_dtype: str = _arg("auto", "KV-cache storage: auto (the model's dtype), int8 (a scale per token and "
                                       "kv head) or fp8_e4m3 (fp8 is the same; also a scale per token and kv head)")
    enable_prefix_caching: bool = _arg(True, "reuse the KV blocks of prompt prefixes computed before")
    kv_offload_memory: str | int | float | None = _arg(
        None, "a second KV tier in host memory, bytes ('2GiB') or a fraction of available memory: prefix blocks "
              "evicted from the KV cache are kept there and loaded back on a hit instead of recomputed; "
              "--preemption-mode swap keeps preempted requests' blocks there (default: off)")
    kv_offload_disk: str | None = _arg(None, "a directory for a disk KV tier (needs --kv-offload-disk-size): "
                                             "evicted prefix blocks are written there, checksummed, and found "
                                             "again after a restart (default: off)")
    kv_offload_disk_size: str | int | None = _arg(None, "the most bytes the disk KV tier holds ('20GiB'); its "
                                                        "least recently used blocks are deleted past it")
    preemption_mode: str = _arg("recompute", "what a request preempted under KV pressure keeps: recompute (its KV "
                                             "is dropped and computed again) or swap (its blocks go to the "
                                             "--kv-offload-memory tier and come back on resume)")
    max_num_seqs: int = _arg(256, "the most sequences running at once")
    max_num_batched_tokens: int = _arg(2048, "the most tokens one step computes; longer prompts are prefilled "
                                             "in chunks")
    batch_step_tokens: int = _arg(32, "while interactive requests are in the engine, the prompt tokens a step "
                                     "that Batch API lines get together on average (their prefill chunks go "
                                     "into steps that carry an interactive prefill or into one step every 8 "
                                     "that spends the saved share; their decode rows go into every step and "
                                     "are not counted), so that they add little to the interactive requests' "
                                     "step time; with no interactive request in the engine they get the "
                                     "whole step")
    device: str = _arg("auto", "auto, cpu or cuda; auto: cuda if torch sees a CUDA GPU")
    num_threads: int | None = _arg(None, "CPU compute threads, all ranks' together (each rank "
                                         "takes its share; default: one per CPU this process may use; "
                                         "`tokenmill serve` leaves one of them to its API process)")
    tensor_parallel_size: int = _arg(1, "split each layer over this many ranks (a process each, torch.distributed "
                                        "over gloo on a CPU): attention heads, KV heads, MLP and vocabulary; "
                                        "Llama, Mistral, Qwen2, Qwen3 and Phi-3")
    pipeline_parallel_size: int = _arg(1, "split the layer stack into this many stages of contiguous layers (a "
                                          "process per rank, tensor_parallel_size ranks per stage; hidden "
                                          "states passed between stages over gloo); the same models as "
                                          "--tensor-parallel-size")
    data_parallel_size: int = _arg(1, "`tokenmill serve`: run this many engine-core replicas (a process each, with "
                                      "its own executor and KV cache, and its share of --num-threads and "
                                      "--kv-cache-memory) behind the one server; requests go to the least "
                                      "loaded, or to the one holding their prompt's prefix")
    distributed_executor_backend: str | None = _arg(
        None, "how the ranks run: " + ", ".join(DISTRIBUTED_EXECUTOR_BACKENDS) + " (uni: in the engine's "
              "process; mp: a process per rank on this machine; ray: a Ray actor per rank on the Ray cluster "
              "RAY_ADDRESS names, else a local one; default: mp above one rank, else uni)")
    attention_backend: str = _arg("auto", "attention implementation: cpu (tokenmill's C++ kernels), sdpa "
                                          "(torch's scaled_dot_product_attention), torch_ref (the plain "
                                          "reference), triton (paged Triton kernels and fused Triton layers, "
                                          "on a GPU) or cuda (SDPA on a GPU); auto: triton on a GPU, else cpu, "
                                          "or sdpa with --no-cpu-kernels")
    cpu_kernels: bool = _arg(True, "tokenmill's C++ kernels on a CPU (decode attention, fused bf16 ops)")
    enforce_eager: bool = _arg(False, "on a GPU, run decode steps eagerly instead of replaying CUDA graphs "
                                      "captured per padded batch size")
    quantization: str | None = _arg(None, "how the weights are quantized: " + ", ".join(QUANTIZATION_METHODS)
                                    + " (default: as config.json's quantization_config says; int8, int4 and "
                                      "w8a8 quantize a float checkpoint at load by round-to-nearest; int8 and "
                                      "int4 round the lm_head to int8 too)")
    async_scheduling: bool | None = _arg(None, "schedule each step while the one before it runs (default: on "
                                               "where a CPU is free for the scheduling thread beside the compute "
                                               "threads, and always on a GPU or with pipeline parallelism, where "
                                               "it puts two steps of different requests in flight, on two stages "
                                               "at once)")
    speculative_config: dict[str, Any] | str | None = _arg(
        None, "speculative decoding, as JSON: {\"method\": \"ngram\" | \"draft_model\" | \"lookahead\" | "
              "\"medusa\", \"num_speculative_tokens\": k, ...} (vLLM's fields; steps run one at a time "
              "while proposing)")
    runner: str = _arg("auto", "generate (text) or pooling (embeddings, /v1/embeddings and LLM.embed); auto: "
                               "the checkpoint's kind (an encoder such as BertModel pools, a decoder generates)")
    disable_log_stats: bool = _arg(False, "no per-step statistics (bandwidth, FLOP/s, MBU/MFU, batch composition "
                                          "in /metrics and /dashboard): vLLM's switch")
    task: str | None = _arg(None, "older vLLM's name for --runner: generate, or embed for --runner pooling")
    kv_transfer_config: dict[str, Any] | str | None = _arg(
        None, "disaggregated prefill and decode, as JSON (vLLM's KVTransferConfig): {\"kv_role\": \"kv_producer\" | "
              "\"kv_consumer\" | \"kv_both\", \"kv_connector\": \"ZMQConnector\", \"kv_ip\": ..., \"kv_port\": ..., "
              "\"kv_connector_extra_config\": {...}}; see `tokenmill disagg-proxy` (default: off)")
    structured_outputs_config: dict[str, Any] | str | None = _arg(
        None, "structured outputs (response_format, tools, guided_*), as JSON (vLLM's StructuredOutputsConfig): "
              "{\"backend\": \"auto\" | \"xgrammar\" | \"guidance\", \"disable_any_whitespace\": false, "
              "\"disable_additional_properties\": true, \"max_json_whitespace\": null} (default: xgrammar; any "
              "whitespace between JSON tokens, as in vLLM, or at most max_json_whitespace characters (tokenmill's); "
              "objects take only the properties their schema names, with either backend)")
    pooler_config: str | None = _arg(None, "the pooling runner's pooling as JSON, e.g. '{\"pooling_type\": "
                                           "\"MEAN\", \"normalize\": true}' (pooling_type MEAN, CLS or LAST; "
                                           "default: the sentence-transformers config, else LAST, normalised)")

    def create_engine_config(self) -> EngineConfig:
        arch = load_arch_config(self.model)
        runner = self._runner(arch)
        device = resolve_device(self.device)
        dtype = _resolve_dtype(self.dtype, arch, device, runner)
        max_model_len = self._max_model_len(arch, runner)
        # generate models on one rank only (MLA models, and sharded ones, keep float32 weights: ModelCost counts
        # only a whole model's projections and embedding in bf16)
        keep_bf16 = (self.dtype == "auto" and dtype == "float32" and device == "cpu" and bf16_weights_kept(arch)
                     and runner == "generate" and self.cpu_kernels
                     and self.tensor_parallel_size == 1 and self.pipeline_parallel_size == 1)
        self._check_positive()
        kv_storage_dtype(self.kv_cache_dtype, dtype)  # refuses an unknown choice
        backend = self.attention_backend
        if backend == "auto":
            if device == "cuda":  # Triton's kernels where triton is installed, else batched SDPA
                backend = "triton" if importlib.util.find_spec("triton") is not None else "cuda"
            else:
                backend = "cpu" if self.cpu_kernels else "sdpa"
        from tokenmill.attention import available_backends

        if backend not in available_backends():
            raise ValueError(f"attention_backend {backend!r} unknown; choose from {available_backends()}")
        if backend == "triton" and device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend 'triton' runs on a CUDA GPU (on a CPU only under Triton's "
                             "interpreter, TRITON_INTERPRET=1, slowly, for tests); use --attention-backend cpu")
        quantization = resolve_quantization(self.model, self.quantization)
        model = ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer or self.model,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=self.seed,
            arch=arch,
            served_model_name=self.served_model_name or self.model,
            quantization=quantization,
            runner=runner,
            pooler=resolve_pooler_config(self.model, self.pooler_config) if runner == "pooling" else None,
            linear_weight_dtype="bfloat16" if keep_bf16 and quantization is None else None,
        )
        spec = SpeculativeConfig.create(_spec_dict(self.speculative_config), model)
        parallel = resolve_parallel_config(self.tensor_parallel_size, self.distributed_executor_backend, arch,
                                           device, runner, model.quantization is not None, spec is not None,
                                           self.pipeline_parallel_size)
        parallel = dataclasses.replace(parallel, data_parallel_size=self._data_parallel_size(runner))
        if parallel.world_size > 1 and (self.kv_offload_memory is not None or self.kv_offload_disk is not None
                                        or self.preemption_mode == "swap"):
            # a rank's blocks hold only its heads (its stage's layers), and the tiers move one rank's bytes alone
            raise ValueError("the KV tiers (--kv-offload-memory, --kv-offload-disk, --preemption-mode swap) are not "
                             "built for tensor or pipeline parallelism yet; use tensor_parallel_size 1 and "
                             "pipeline_parallel_size 1")
        kv_transfer = resolve_kv_transfer_config(self.kv_transfer_config)
        if kv_transfer is not None and (parallel.world_size > 1 or runner != "generate"):
            raise ValueError("kv_transfer_config needs a generating model on one rank (tensor_parallel_size 1 and "
                             "pipeline_parallel_size 1): a rank's blocks hold only its heads or its stage's layers")
        pipeline = parallel.pipeline_parallel_size
        # (with pipeline stages, two steps in flight keep two stages busy: on by default there)
        async_scheduling = (self.async_scheduling if self.async_scheduling is not None
                            else pipeline > 1 or default_async_scheduling(device, self.num_threads))
        return EngineConfig(
            model=model,
            cache=CacheConfig(
                block_size=self.block_size if self.block_size is not None else default_block_size(device),
                kv_cache_bytes=self._kv_cache_bytes(),
                num_kv_blocks=self.num_kv_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_dtype=self.kv_cache_dtype,
                **self._kv_offload(),
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=max_model_len,
                async_scheduling=async_scheduling,
                lower_class_step_tokens=self.batch_step_tokens,
                schedule_tokens_in_flight=pipeline == 1,
            ),
            device=DeviceConfig(device=device, num_threads=self.num_threads, cpu_kernels=self.cpu_kernels,
                                enforce_eager=self.enforce_eager),
            attention_backend=backend,
            speculative=spec,
            log_stats=not self.disable_log_stats,
            parallel=parallel,
            kv_transfer=kv_transfer,
            structured_outputs=resolve_structured_outputs_config(self.structured_outputs_config),
        )

    def _data_parallel_size(self, runner: str) -> int:
        dp = self.data_parallel_size
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got {dp!r}")
        if dp > 1 and runner != "generate":
            raise ValueError("data parallelism runs generating models; an embedding server (--runner pooling) runs "
                             "one replica: use data_parallel_size 1")
        return dp

    def _runner(self, arch: ArchConfig) -> str:
        runner = self.runner
        if self.task is not None:
            tasks = {"generate": "generate", "embed": "pooling"}
            if self.task not in tasks:
                raise ValueError(f"task must be generate or embed, got {self.task!r}")
            if runner not in ("auto", tasks[self.task]):
                raise ValueError(f"task {self.task!r} contradicts runner {runner!r}; give one of them")
            runner = tasks[self.task]
        if runner == "auto":
            runner = arch.default_runner
        if runner not in RUNNERS:
            raise ValueError(f"runner must be auto, generate or pooling, got {runner!r}")
        if runner == "generate" and arch.default_runner == "pooling":
            raise ValueError(f"{arch.architecture} is an embedding model: it has no language-model head to generate "
                             "with; serve it with --runner pooling")
        if runner != "pooling" and self.pooler_config is not None:
            raise ValueError("pooler_config applies to the pooling runner only (--runner pooling)")
        return runner

    def _max_model_len(self, arch: ArchConfig, runner: str = "generate") -> int:
        limit = arch.max_position_embeddings
        if self.max_model_len is None:
            # sentence-transformers encodes at most max_seq_length tokens; its embeddings are trained so
            seq_limit = checkpoint_max_seq_length(self.model) if runner == "pooling" else None
            return min(limit, seq_limit) if seq_limit else limit
        if self.max_model_len < 1 or self.max_model_len > limit:
            raise ValueError(
                f"max_model_len {self.max_model_len} must be between 1 and the model's "
                f"max_position_embeddings ({limit})"
            )
        return self.max_model_len

    def _check_positive(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "batch_step_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:  # block_size None: the device's default
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")

    def _kv_cache_bytes(self) -> int:
        if self.kv_cache_memory is None:
            return int(min(DEFAULT_KV_CACHE_BYTES, 0.3 * psutil.virtual_memory().available))
        value = parse_memory(self.kv_cache_memory)
        if isinstance(value, float):
            if not 0 < value <= 1:
                raise ValueError(f"kv_cache_memory fraction must be in (0, 1], got {value}")
            return int(value * psutil.virtual_memory().available)
        if value <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {value}")
        return value

    def _kv_offload(self) -> dict[str, Any]:
        """The second tier's fields of CacheConfig, checked."""
        memory = 0
        if self.kv_offload_memory is not None:
            value = parse_memory(self.kv_offload_memory, "kv_offload_memory")
            if isinstance(value, float):
                if not 0 < value <= 1:
                    raise ValueError(f"kv_offload_memory fraction must be in (0, 1], got {value}")
                value = int(value * psutil.virtual_memory().available)
            if value <= 0:
                raise ValueError(f"kv_offload_memory must be positive, got {self.kv_offload_memory!r}")
            memory = value
        disk_bytes = 0
        if (self.kv_offload_disk is None) != (self.kv_offload_disk_size is None):
            raise ValueError("kv_offload_disk and kv_offload_disk_size go together: give both (a directory and "
                             "a size like '20GiB') or neither")
        if self.kv_offload_disk is not None and self.kv_offload_disk_size is not None:
            size = parse_memory(self.kv_offload_disk_size, "kv_offload_disk_size")
            if isinstance(size, float) or size <= 0:
                raise ValueError(f"kv_offload_disk_size must be a positive size like '20GiB', got "
                                 f"{self.kv_offload_disk_size!r}")
            if not self.enable_prefix_caching:
                raise ValueError("kv_offload_disk keeps prefix-cached blocks: it needs prefix caching on")
            _check_writable_dir(self.kv_offload_disk)
            disk_bytes = size
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and not memory:
            raise ValueError("preemption_mode swap keeps preempted requests' blocks in host memory: give "
                             "kv_offload_memory (e.g. '2GiB') too")
        return {"kv_offload_memory_bytes": memory, "kv_offload_disk": self.kv_offload_disk,
                "kv_offload_disk_bytes": disk_bytes, "preemption_mode": self.preemption_mode}

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One option per field but `model` (each subcommand takes it its own way), with the field's help."""
        for f in fields(cls):
            if f.name == "model":
                continue
            flag = "--" + f.name.replace("_", "-")
            default = None if f.default is MISSING else f.default
            doc = f.metadata["help"]
            if isinstance(default, bool):
                doc += f" (default: {'on' if default else 'off'})"
            elif default is not None:  # a None default is described in the help itself
                doc += f" (default: {default})"
            if f.type in ("bool", "bool | None"):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=doc)
            elif f.type in ("int", "int | None"):
                parser.add_argument(flag, type=int, default=default, help=doc)
            elif f.name == "dtype":
                parser.add_argument(flag, choices=DTYPES, default=default, help=doc)
            elif f.name == "kv_cache_dtype":
                parser.add_argument(flag, choices=KV_CACHE_DTYPE_CHOICES, default=default, help=doc)
            elif f.name == "preemption_mode":
                parser.add_argument(flag, choices=PREEMPTION_MODES, default=default, help=doc)
            else:
                parser.add_argument(flag, type=str, default=default, help=doc)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})


def _check_writable_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"kv_offload_disk {path!r} cannot be made a directory: {e.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"kv_offload_disk {path!r} is not a directory this process can write")


def _spec_dict(value: dict[str, Any] | str | None) -> dict[str, Any] | None:
    """speculative_config as given: a dict (Python), or its JSON (the CLI)."""
    return None if value is None else json_object(value, "speculative_config")


def default_block_size(device: str) -> int:
    return 32 if device == "cpu" else 16


def resolve_device(device: str) -> str:
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if device == "cpu":
        return device
    if device == "auto" and not _gpu_device_nodes():
        return "cpu"  # no torch import (seconds of start-up) in a process that needs none
    import torch

    has_cuda = torch.cuda.is_available()
    if device == "cuda" and not has_cuda:
        raise ValueError("device 'cuda' asked for, but torch sees no CUDA GPU")
    return "cuda" if has_cuda else "cpu"


def _gpu_device_nodes() -> bool:
    """Whether this machine shows an NVIDIA (or ROCm) device node: without one torch sees no GPU."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")


# the dtypes a checkpoint's config.json may name for "auto" to run it in (torch's aliases included)
_CHECKPOINT_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32",
                      "float": "float32"}


def _resolve_dtype(dtype: str, arch: ArchConfig, device: str, runner: str = "generate") -> str:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if dtype == "auto":
        if arch.dtype is None:
            # an embedding checkpoint that names no dtype runs as sentence-transformers runs it
            dtype = "float32" if runner == "pooling" else "bfloat16"
        elif isinstance(arch.dtype, str) and arch.dtype in _CHECKPOINT_DTYPES:
            dtype = _CHECKPOINT_DTYPES[arch.dtype]
        else:
            raise ValueError(f"the checkpoint's config.json gives dtype {arch.dtype!r}, which tokenmill does not "
                             "know; set --dtype (dtype=) to bfloat16, float16 or float32 to run it in that")
        if dtype == "float16" and device == "cpu":
            dtype = "bfloat16"  # fp16 matmul is orders of magnitude slower than bf16 on CPUs
        if dtype == "bfloat16" and device == "cpu" and not cpu_runs_bf16():
            # an AVX2-only CPU: torch's bf16 linear layers are slower than float32 ones there
            logger.warning("this CPU has no bfloat16 matmul (AVX-512 BW/VL/DQ or AVX-NE-CONVERT): running the "
                           "model in float32 (--dtype bfloat16 keeps it in bfloat16)")
            dtype = "float32"
    return dtype


def default_async_scheduling(device: str, num_threads: int | None, busy_cpus: int = 0) -> bool:
    """Async scheduling pays where the scheduling thread has a CPU of its own beside the compute
    threads and busy_cpus others (the serving API process); sharing one, it slows the steps down
    (bench/README.md, "Where the defaults come from"). Always on a GPU, where the compute is not on a CPU."""
    if device == "cuda":
        return True
    cpus = default_num_threads()
    return cpus > (num_threads or cpus) + busy_cpus


def default_num_threads(busy_cpus: int = 0) -> int:
    """Compute threads when none are asked for: one per CPU this process may run on, less
    busy_cpus left to other work (`tokenmill serve` leaves one to its API process); at least one."""
    return max(1, len(os.sched_getaffinity(0)) - busy_cpus)
