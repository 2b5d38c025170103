#!/usr/bin/env bash
# The GPU checks of one session on one NVIDIA GPU, most wanted first, inside one time budget:
#   G4   the decode step with and without CUDA graphs at batch 1, 32 and 256 (greedy tokens compared);
#   tests the CUDA tests (Triton kernels in every dtype; the engine's greedy tokens against
#        transformers under every scheduling feature, through the CUDA graphs and eagerly);
#   G5   W1 at GPU size: the continuous and static policies and transformers' static generate();
#   G3   W2 at GPU size, static before continuous (the earlier runs measured continuous first);
#   G1   the decode roofline;  G2  paged attention at Llama-3-8B's heads.
# Every engine benchmark runs on a random-weight Llama-3.2-1B-shaped checkpoint in bfloat16.
#
#   bash client/bench/scripts/gpu_checks.sh OUT_DIR [PYTHON]
#
# Writes OUT_DIR/gpu_checks.log (every step's output) and, per benchmark, <step>.json (tests:
# gpu_tests.xml): seven files, for a device call that returns at most eight. Each step has
# its own time limit (G4_TIMEOUT, TESTS_TIMEOUT, G5_TIMEOUT, G3_TIMEOUT, G1_TIMEOUT, G2_TIMEOUT
# seconds) and none runs past BUDGET seconds from the start (default 540, for a 600 s call), so
# a step that hangs costs only its share of a short GPU lease; STEPS picks and orders the steps.
# Needs the project's Python packages and the default checkpoint's tokenizer (`make setup`, or
# client/bench/scripts/device_wheels.sh's .gpu/ on a machine without a package index).
set -u
out=${1:?usage: bash client/bench/scripts/gpu_checks.sh OUT_DIR [PYTHON]}
py=${2:-python3}
mkdir -p "$out"
logs=$(mktemp -d)
export PYTHONUNBUFFERED=1
budget=${BUDGET:-540}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
"$py" -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
"$py" -c "import vllm; print('vllm', vllm.__version__)" 2>&1 | tail -1

# Runs "$@" for at most $1 seconds and never past the budget; logs to OUT_DIR/$2.log.
step() {
    local limit=$1 name=$2 left=$((budget - SECONDS)) start=$SECONDS
    shift 2
    if ((left < 20)); then echo "$name: skipped, $left s of the budget left"; return; fi
    ((limit > left)) && limit=$left
    timeout "$limit" "$@" >"$logs/$name.log" 2>&1
    echo "$name: exit $? in $((SECONDS - start)) s (limit $limit s)"
    tail -"${TAIL:-14}" "$logs/$name.log"
    { echo "==> $name"; cat "$logs/$name.log"; } >>"$out/gpu_checks.log"
}

ckpt=${GPU_CHECKPOINT:-/tmp/random-llama3-1b}
start=$SECONDS
"$py" -m tools.random_checkpoint "$ckpt" --shape llama3-1b --dtype bfloat16 >/dev/null 2>&1 || echo "checkpoint failed"
echo "checkpoint in $((SECONDS - start)) s"
note="random-weight Llama-3.2-1B shape (python -m tools.random_checkpoint --shape llama3-1b --dtype bfloat16)"
# G3's and G5's KV pool holds every request of the workload at its longest (256 x 2048 tokens of 32 KiB).
engine=(--engine device=cuda --engine dtype=bfloat16 --engine kv_cache_memory_mb=20480 --no-progress --note "$note")

for name in ${STEPS:-g4 tests g5 g3 g1 g2}; do
    case $name in
    g4) step "${G4_TIMEOUT:-150}" g4 "$py" -m client.bench.cuda_graphs --model "$ckpt" --device cuda --dtype bfloat16 \
            --batch 1,32,256 --context 512 --steps 32 --json "$out/g4.json" ;;
    tests) TAIL=25 step "${TESTS_TIMEOUT:-200}" gpu_tests "$py" -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-8}" \
            -m "not slow" -k cuda --junitxml="$out/gpu_tests.xml" tests/kernels/test_kernels_cuda.py \
            tests/unit/test_sampler_cuda.py tests/engine/test_engine_equivalence.py tests/engine/test_cuda_graphs.py ;;
    g5) TAIL=24 step "${G5_TIMEOUT:-200}" g5 "$py" -m client.bench G5 --model "$ckpt" \
            --systems "${G5_SYSTEMS:-continuous,static,hf-static}" "${engine[@]}" --json "$out/g5.json" ;;
    g3) TAIL=24 step "${G3_TIMEOUT:-120}" g3 "$py" -m client.bench G3 --model "$ckpt" \
            --systems "${G3_SYSTEMS:-static,continuous}" "${engine[@]}" --json "$out/g3.json" ;;
    g1) step "${G1_TIMEOUT:-90}" g1 "$py" -m client.bench.roofline --model "$ckpt" --device cuda --dtype bfloat16 \
            --json "$out/g1.json" ;;
    g2) TAIL=16 step "${G2_TIMEOUT:-120}" g2 "$py" -m client.bench.attention --device cuda --dtype bfloat16 \
            --json "$out/g2.json" ;;
    *) echo "unknown step $name" ;;
    esac
done
echo "total $SECONDS s"
