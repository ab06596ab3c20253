#!/usr/bin/env bash
# The GPU path's checks and targets (issue #26) in one run on a CUDA machine, with no network; about 7 minutes
# on an H100/H200 (every step's limit together: 9.5). Run from the repository root:
#
#     OUT=/some/dir tools/gpu_check.sh            # results in $OUT (default: /tmp/gpu_check)
#
# Uses the machine's python3 (CUDA torch, triton, transformers, pytest) with src/ on PYTHONPATH; Python wheels
# the machine lacks (tokenmill needs msgspec and platformdirs there) are installed from .whl/ if present (tools/gpu_wheels.sh
# downloads them on a machine with PyPI, transformers among them so that the golden tests compare with the
# version tokenmill is tested against here). GPU_CHECK_SKIP="hf_256 ..." skips steps by name, GPU_CHECK_TESTS
# replaces the pytest step's test list. Steps, each under its own time limit; every result is one line of
# $OUT/results.jsonl named by its step ("result"), every step's output goes to $OUT/gpu_check.log, and
# $OUT/summary.txt lists each step's exit status and time (a step that fails or times out, the rest go on):
#   pytest                 the Triton kernels on the GPU, the CUDA-graph logic, the golden tests of every family
#                          with the triton backend, CUDA graphs on and off, the SDPA backend's (also junit.xml)
#   build_model            a random 1.1B Llama (TinyLlama's shape, bf16), built locally
#   roofline               the device's copy bandwidth (mem_copy_GBps) and bf16 matmul rate (8192^3)
#   latency_b1_*           batch-1 decode, MBU against that copy bandwidth: triton + graphs; SDPA eager (before)
#   throughput_256, hf_256 offline 256 requests (32:512 in, 32:256 out): tokenmill vs HF generate (batch 64, 256)
#   throughput_b256_p1000  batch 256 with 1,000-token prompts: tokens/s and MFU
#   prefill_8k             8 x 1,024-token prompts in one 8k-token step: prefill MFU
#   step_split_*           per decode step, GPU-kernel time vs idle gaps (torch profiler): before and after
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
MODEL=${GPU_CHECK_MODEL:-/tmp/gpu_check_llama_1.1b}
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

step() {  # step NAME SECONDS CMD...: CMD under a time limit, its output to the log, its status to the summary
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    case " ${GPU_CHECK_SKIP:-} " in *" $name "*) echo "$name skipped" | tee -a "$SUMMARY"; return;; esac
    echo "=== $name: $*" >> "$LOG"
    timeout "$limit" "$@" >> "$LOG" 2>&1
    rc=$?
    echo "$name rc=$rc took=$((SECONDS - t0))s at=${SECONDS}s" | tee -a "$SUMMARY"
}
result() {  # result NAME: the options that make a bench command append its JSON line to results.jsonl
    echo --output-jsonl "$RESULTS" --result-name "$1"
}

"$PY" -c 'import torch, triton; assert torch.cuda.is_available(), "no CUDA GPU"
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())' \
    | tee -a "$SUMMARY" || exit 1

TESTS=${GPU_CHECK_TESTS:-tests/kernels/triton tests/worker/test_cuda_graphs.py tests/attention/test_backends.py \
tests/models/test_golden.py::test_cuda_triton tests/models/test_golden.py::test_triton_backend}
# shellcheck disable=SC2086  # (a list of test paths)
step pytest 110 "$PY" -m pytest -q -p no:cacheprovider --junitxml="$OUT/junit.xml" $TESTS

[ -f "$MODEL/config.json" ] || step build_model 60 "$PY" tools/build_random_model.py llama-1.1b "$MODEL"

step roofline 30 "${TM[@]}" bench roofline --device cuda --gib 4 --n 8192 --no-cache $(result roofline)
read -r COPY FLOPS < <("$PY" -c "import json
r = [json.loads(x) for x in open('$RESULTS') if '\"roofline\"' in x][-1]
print(r['mem_copy_GBps'], r['matmul_bf16_gflops'])")
echo "copy_GBps=$COPY bf16_gflops=$FLOPS" | tee -a "$SUMMARY"
BENCH=(--model "$MODEL" --bandwidth "$COPY" --flops "$FLOPS" --device cuda --dtype bfloat16 --kv-cache-memory 16GiB)

step latency_b1_triton 40 "${TM[@]}" bench latency "${BENCH[@]}" --batch-size 1 --input-len 128 --output-len 256 \
    --runs 3 $(result latency_b1_triton)
step latency_b1_sdpa_eager 40 "${TM[@]}" bench latency "${BENCH[@]}" --batch-size 1 --input-len 128 \
    --output-len 256 --runs 3 --attention-backend cuda --enforce-eager $(result latency_b1_sdpa_eager)

step throughput_256 60 "${TM[@]}" bench throughput "${BENCH[@]}" --num-prompts 256 --input-len 32:512 \
    --output-len 32:256 --runs 2 $(result throughput_256)
step hf_256 60 sh -c "'$PY' tools/gpu_bench.py hf '$MODEL' --batch-sizes 64,256 >> '$RESULTS'"

step throughput_b256_p1000 60 "${TM[@]}" bench throughput "${BENCH[@]}" --num-prompts 256 --input-len 1000 \
    --output-len 128 --runs 1 --max-num-seqs 256 --max-num-batched-tokens 8192 $(result throughput_b256_p1000)
step prefill_8k 35 "${TM[@]}" bench latency "${BENCH[@]}" --batch-size 8 --input-len 1024 --output-len 2 \
    --runs 3 --max-num-batched-tokens 8192 $(result prefill_8k)

step step_split_sdpa_eager 35 sh -c "'$PY' tools/gpu_bench.py profile --attention-backend cuda --enforce-eager \
    --dtype bfloat16 --kv-cache-memory 16GiB '$MODEL' >> '$RESULTS'"
step step_split_triton 35 sh -c "'$PY' tools/gpu_bench.py profile --dtype bfloat16 --kv-cache-memory 16GiB '$MODEL' >> '$RESULTS'"
echo "done in ${SECONDS}s" | tee -a "$SUMMARY"
