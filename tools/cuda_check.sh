#!/usr/bin/env bash
# The CUDA checks, in one call on a lent GPU: CUDA graph tests, row invariance, end-to-end greedy identity
# and speed, precision agreement, cost curves per precision with graphs and eagerly, then what the
# row-invariant attention kernel costs against cuDNN's (tools/compile_probe.py ran once, see
# docs/benchmarks/cuda-h200). The real SmolLM2 weights (98 MB) cannot travel with the call: a
# SmolLM2-135M-shaped model with random weights stands in for timing and identity; the shipped draft model
# (real weights, SmolLM2's family) for agreement between precisions.
set -uo pipefail
export SPECULANT_NATIVE=off PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/cuda-check}
DRAFT=speculant/data/drafts/smollm2-135m-instruct/draft_model
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
python3 tools/random_smollm2.py /tmp/random-smollm2
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/models/test_cuda_graphs.py -k cuda 2>&1 | tail -15
timeout 200 python3 -m speculant.bench.cuda_check --model /tmp/random-smollm2 --draft-model $DRAFT \
    --agreement-model $DRAFT 2>&1 | tee "$OUT/cuda_check.md"
timeout 90 python3 -m speculant.bench.precisions --device cuda --model /tmp/random-smollm2 --rounds 20 \
    --max-width 16 2>&1 | tee "$OUT/precisions.md"
timeout 120 python3 tools/attention_probe.py /tmp/random-smollm2 2>&1 | grep -v Warning | tee "$OUT/attention.txt"
