#!/usr/bin/env bash
# The GPU path's checks and targets (issue #26) in one run on a CUDA machine, with no network; under 8 minutes
# on an H100/H200. Run from the repository root:
#
#     OUT=/some/dir tools/gpu_check.sh            # results in $OUT (default: /tmp/gpu_check)
#
# Uses the machine's python3 (CUDA torch, triton, transformers, pytest) with src/ on PYTHONPATH; Python wheels
# the machine lacks (tokenmill needs msgspec and platformdirs there) are installed from .whl/ if present (tools/gpu_wheels.sh
# downloads them on a machine with PyPI, transformers among them so that the golden tests compare with the
# version tokenmill is tested against here). GPU_CHECK_SKIP="hf_256 ..." skips steps by name, GPU_CHECK_TESTS
# replaces the golden step's test list, GPU_CHECK_KERNELS the kernels step's, GPU_CHECK_DEADLINE (seconds, 540) is
# when the run ends: each step's limit is cut to the time left, and a step with under 10 s left is skipped. Every
# result is one line of $OUT/results.jsonl named by its step ("result"), every step's output goes to
# $OUT/gpu_check.log, and $OUT/summary.txt lists each step's exit status and time (a step that fails or times
# out, the rest go on; only the gate stops the run). Steps, most wanted first:
#   gate                   a short generation on the demo model, triton backend with CUDA graphs
#   build_model            a random 1.1B Llama (TinyLlama's shape, bf16), built on the CPU during the golden step
#   golden                 the golden tests of every family with the triton backend, CUDA graphs on and off, the
#                          CUDA-graph logic, the SDPA backend's (junit_golden.xml)
#   roofline               the device's copy bandwidth (mem_copy_GBps) and bf16 matmul rate (8192^3)
#   latency_b1_triton      batch-1 decode, MBU against that copy bandwidth: triton + graphs
#   pdl_ab                 the same with programmatic dependent launch off (TOKENMILL_PDL=0), then on; the
#                          step's graph replayed alone, off and on twice (gpu_bench.py --replay)
#   throughput_256, hf_256 offline 256 requests (32:512 in, 32:256 out): tokenmill vs HF generate (batch 256, 64)
#   throughput_b256_p1000  batch 256 with 1,000-token prompts: tokens/s and MFU
#   prefill_8k             8 x 1,024-token prompts in one 8k-token step: prefill MFU
#   latency_b1_sdpa_eager  batch-1 decode before: SDPA backend, eager
#   step_split_*           per decode step, GPU-kernel time vs idle gaps (torch profiler): before and after
#   launch_ahead_ab        decode step time at batch 1/8/64/256, launch-ahead off and on (no profiler)
#   gemv_ab                decode step time at batch 1, the Triton GEMV off (cuBLAS) and on (no profiler)
#   gated_ab               batch-1 decode step time, SiLU-and-mul in the down projection's GEMV off and on
#   gemv_bench             tools/gemv_bench.py --sweep (or GPU_CHECK_GEMV_BENCH): the GEMV vs cuBLAS per shape, rows 1-8
#   gemv_tune              batch-1 graph replay over GEMV tiles and the gated form; batch 64 with PDL off and on
#   kernels_b1             the GPU kernels of a batch-1 decode step by their time (kernels_b1.txt)
#   kernels                the Triton kernels' tests on the GPU (junit_kernels.xml)
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
MODEL=${GPU_CHECK_MODEL:-/tmp/gpu_check_llama_1.1b}
DEADLINE=${GPU_CHECK_DEADLINE:-540}  # seconds from the start: later steps' limits are cut to end by then
SUMMARY="$OUT/summary.txt" LOG="$OUT/gpu_check.log" RESULTS="$OUT/results.jsonl"
: > "$SUMMARY"
: > "$LOG"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_check_site .whl/*.whl \
        && export PYTHONPATH=/tmp/gpu_check_site
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
TM=("$PY" -c 'import sys; from tokenmill.entrypoints.cli import main; sys.exit(main())')

step() {  # step NAME SECONDS CMD...: CMD under a time limit (cut to what DEADLINE leaves), its output to the
          # log, its status to the summary and to LAST_RC
    local name=$1 limit=$2 t0=$SECONDS left=$((DEADLINE - SECONDS))
    shift 2
    LAST_RC=skipped
    case " ${GPU_CHECK_SKIP:-} " in *" $name "*) echo "$name skipped" | tee -a "$SUMMARY"; return;; esac
    [ "$left" -lt 10 ] && { echo "$name skipped (deadline)" | tee -a "$SUMMARY"; return; }
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name: $*" >> "$LOG"
    timeout "$limit" "$@" >> "$LOG" 2>&1
    LAST_RC=$?
    echo "$name rc=$LAST_RC took=$((SECONDS - t0))s at=${SECONDS}s" | tee -a "$SUMMARY"
}
result() {  # result NAME: the options that make a bench command append its JSON line to results.jsonl
    echo --output-jsonl "$RESULTS" --result-name "$1"
}

"$PY" -c 'import torch, triton; assert torch.cuda.is_available(), "no CUDA GPU"
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())' \
    | tee -a "$SUMMARY" || exit 1

# the gate: one short generation through the triton backend with CUDA graphs, on the shipped demo model; if
# that fails, every later step would too, so the run ends here (and holds the device no longer)
step gate 60 "$PY" -c 'from tokenmill import LLM, SamplingParams
llm = LLM("models/tokenmill-demo", device="cuda", dtype="bfloat16", kv_cache_memory="1GiB", max_num_seqs=8)
out = llm.generate(["The cat sat on the mat.", "Once upon a time"], SamplingParams(temperature=0.0, max_tokens=16),
                   use_tqdm=False)
print([o.outputs[0].text for o in out], "graphs:", llm.engine.core.executor.worker.model_runner.graphs is not None)'
[ "$LAST_RC" = 0 ] || { echo "gate failed: stopping" | tee -a "$SUMMARY"; exit 1; }

# the 1.1B model builds on the CPU while the golden tests run
if [ ! -f "$MODEL/config.json" ]; then
    ( t0=$SECONDS; timeout 150 "$PY" tools/build_random_model.py llama-1.1b "$MODEL" > "$OUT/build_model.log" 2>&1
      echo "build_model rc=$? took=$((SECONDS - t0))s (in the background)" >> "$SUMMARY" ) &
    BUILD=$!
fi

GOLDEN=${GPU_CHECK_TESTS:-tests/models/test_golden.py::test_cuda_triton tests/models/test_golden.py::test_triton_backend \
tests/worker/test_cuda_graphs.py tests/attention/test_backends.py}
# shellcheck disable=SC2086  # (a list of test paths)
step golden 150 "$PY" -m pytest -q -p no:cacheprovider --junitxml="$OUT/junit_golden.xml" $GOLDEN
[ -n "${BUILD:-}" ] && wait "$BUILD"

step roofline 30 "${TM[@]}" bench roofline --device cuda --gib 4 --n 8192 --no-cache $(result roofline)
read -r COPY FLOPS < <("$PY" -c "import json
r = [json.loads(x) for x in open('$RESULTS') if '\"roofline\"' in x][-1]
print(r['mem_copy_GBps'], r['matmul_bf16_gflops'])")
echo "copy_GBps=$COPY bf16_gflops=$FLOPS" | tee -a "$SUMMARY"
BENCH=(--model "$MODEL" --bandwidth "$COPY" --flops "$FLOPS" --device cuda --dtype bfloat16 --kv-cache-memory 16GiB)

step latency_b1_triton 45 "${TM[@]}" bench latency "${BENCH[@]}" --batch-size 1 --input-len 128 --output-len 256 \
    --runs 3 $(result latency_b1_triton)
# programmatic dependent launch (kernels/triton/common.py): the same batch-1 run with it off, then on again;
# then off/on twice more in tools/gpu_bench.py, which also times the step's CUDA graph replayed back to back
step pdl_ab 150 sh -c "for p in 0 1; do TOKENMILL_PDL=\$p \"\$@\" --runs 3 --output-jsonl '$RESULTS' \
    --result-name latency_b1_pdl\$p || exit; done; for p in 0 1 0 1; do TOKENMILL_PDL=\$p '$PY' tools/gpu_bench.py \
    profile --no-profiler --replay 512 --batch 1 --steps 256 --max-num-seqs 8 --dtype bfloat16 \
    --kv-cache-memory 16GiB '$MODEL' >> '$RESULTS' || exit; done" sh "${TM[@]}" bench latency "${BENCH[@]}" \
    --batch-size 1 --input-len 128 --output-len 256
# the decode GEMV (kernels/triton/gemv.py): batch-1 decode with it off (cuBLAS) and on, back to back
# (GPU_CHECK_AB_BATCHES: other batch sizes too); the GEMV against cuBLAS per projection shape of the 1.1B model (rows 1 to 8)
# with a sweep of its tile configurations; the GPU kernels of a batch-1 step by their time (kernels_b1.txt)
step gemv_ab 100 sh -c "for b in ${GPU_CHECK_AB_BATCHES:-1}; do for g in off on; do '$PY' tools/gpu_bench.py profile --no-profiler --gemv \$g \
    --batch \$b --steps 256 --max-num-seqs 8 --dtype bfloat16 --kv-cache-memory 16GiB '$MODEL' >> '$RESULTS' || exit; \
    done; done"
step gated_ab 60 sh -c "for g in off on; do '$PY' tools/gpu_bench.py profile --no-profiler --gated \$g --batch 1 \
    --steps 256 --max-num-seqs 8 --dtype bfloat16 --kv-cache-memory 16GiB '$MODEL' >> '$RESULTS' || exit; done"
step gemv_bench 120 sh -c "'$PY' tools/gemv_bench.py ${GPU_CHECK_GEMV_BENCH:---sweep} >> '$RESULTS'"
# batch-1 decode's CUDA graph replayed alone (gpu_bench.py --replay) with the GEMV's tiles and the gated form
# varied (GPU_CHECK_TUNE: one set of gpu_bench options a line), then at batch 64 with PDL off and on
step gemv_tune 150 sh -c "printf '%s\n' \"\${GPU_CHECK_TUNE:---gated on
--gated off
--gemv-config 4,1024,4
--gemv-config 4,1024,8
--gemv-config 2,2048,8
--gemv-config 1,2048,4}\" | while read -r opts; do '$PY' tools/gpu_bench.py profile --no-profiler --replay 512 \
    --batch 1 --steps 64 --max-num-seqs 8 --dtype bfloat16 --kv-cache-memory 16GiB \$opts '$MODEL' >> '$RESULTS' \
    || exit; done || exit; for p in 0 1; do TOKENMILL_PDL=\$p '$PY' tools/gpu_bench.py profile --no-profiler --replay 256 \
    --batch 64 --steps 32 --max-num-seqs 64 --dtype bfloat16 --kv-cache-memory 16GiB '$MODEL' >> '$RESULTS' || exit; done"
step kernels_b1 40 sh -c "'$PY' tools/gpu_bench.py profile --batch 1 --steps 64 --max-num-seqs 8 --dtype bfloat16 \
    --kv-cache-memory 16GiB --table '$OUT/kernels_b1.txt' --table-sort self_device_time_total '$MODEL' >> '$RESULTS'"
step throughput_256 60 "${TM[@]}" bench throughput "${BENCH[@]}" --num-prompts 256 --input-len 32:512 \
    --output-len 32:256 --runs 2 $(result throughput_256)
step hf_256 80 sh -c "'$PY' tools/gpu_bench.py hf '$MODEL' --batch-sizes 256,64 >> '$RESULTS'"
step throughput_b256_p1000 50 "${TM[@]}" bench throughput "${BENCH[@]}" --num-prompts 256 --input-len 1000 \
    --output-len 128 --runs 1 --max-num-seqs 256 --max-num-batched-tokens 8192 $(result throughput_b256_p1000)
step prefill_8k 35 "${TM[@]}" bench latency "${BENCH[@]}" --batch-size 8 --input-len 1024 --output-len 2 \
    --runs 3 --max-num-batched-tokens 8192 $(result prefill_8k)
step latency_b1_sdpa_eager 40 "${TM[@]}" bench latency "${BENCH[@]}" --batch-size 1 --input-len 128 \
    --output-len 256 --runs 3 --attention-backend cuda --enforce-eager $(result latency_b1_sdpa_eager)
step step_split_sdpa_eager 35 sh -c "'$PY' tools/gpu_bench.py profile --attention-backend cuda --enforce-eager \
    --dtype bfloat16 --kv-cache-memory 16GiB '$MODEL' >> '$RESULTS'"
step step_split_triton 35 sh -c "'$PY' tools/gpu_bench.py profile --dtype bfloat16 --kv-cache-memory 16GiB '$MODEL' >> '$RESULTS'"

# decode step time without the profiler, the worker thread running every step (launch-ahead off) against
# ModelRunner.launch, at batch 1, 8, 64 and 256, each pair back to back
step launch_ahead_ab 150 sh -c "for b in 1 8 64 256; do for la in off on; do '$PY' tools/gpu_bench.py profile \
    --no-profiler --launch-ahead \$la --batch \$b --steps 64 --dtype bfloat16 --kv-cache-memory 16GiB '$MODEL' \
    >> '$RESULTS' || exit; done; done"

KERNELS=${GPU_CHECK_KERNELS:-tests/kernels/triton}
# shellcheck disable=SC2086
step kernels 120 "$PY" -m pytest -q -p no:cacheprovider --junitxml="$OUT/junit_kernels.xml" $KERNELS
echo "done in ${SECONDS}s" | tee -a "$SUMMARY"
