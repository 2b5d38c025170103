#!/usr/bin/env bash
# The quantized-weights benchmarks of docs/benchmarks.md (Q1, Q2) on this machine, one at a
# time: a decode step at batch 1 against the memory roofline of its own bytes (G1's method) on
# a Llama-3.2-1B-shaped checkpoint in bfloat16, int8 and int4 (groups of 128), then W1 at 32 in
# flight on the default checkpoint in float32, int8 and int4.
#
#   bash client/bench/scripts/quant_checks.sh OUT_DIR [PYTHON]
#
# Writes OUT_DIR/q1_g1_llama3_1b_<weights>.json and OUT_DIR/q2_w1_<weights>.json. The 1B
# checkpoint is random weights (python -m tools.random_checkpoint --shape llama3-1b, 2.4 GB).
set -u
out=${1:?usage: bash client/bench/scripts/quant_checks.sh OUT_DIR [PYTHON]}
py=${2:-.venv/bin/python}
mkdir -p "$out"
ckpt=${Q1_CHECKPOINT:-.models/random-llama3-1b}
"$py" -m tools.random_checkpoint "$ckpt" --shape llama3-1b --dtype bfloat16 >/dev/null 2>&1 || echo "checkpoint failed"
for weights in bf16 int8 int4; do
    case $weights in
        bf16) args=(--dtype bfloat16) ;;
        int8) args=(--dtype bfloat16 --quantization int8) ;;
        int4) args=(--dtype bfloat16 --quantization int4 --group-size 128) ;;
    esac
    "$py" -m client.bench.roofline --model "$ckpt" --batch 1 --context 256 --seconds 1 --windows 3 "${args[@]}" \
        --json "$out/q1_g1_llama3_1b_$weights.json" | tail -2
done
for weights in fp32 int8 int4; do
    case $weights in
        fp32) args=(--engine dtype=float32) ;;
        int8) args=(--engine dtype=float32 --engine quantization=int8) ;;
        int4) args=(--engine dtype=float32 --engine quantization=int4 --engine quantization_group_size=128) ;;
    esac
    "$py" -m client.bench W1 --systems continuous "${args[@]}" --no-progress --json "$out/q2_w1_$weights.json" \
        | grep -i "continuous" | tail -1
done
