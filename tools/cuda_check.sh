#!/usr/bin/env bash
# The CUDA checks, in one call on a lent GPU: CUDA graph tests, cost curves per precision
# with graphs and eagerly, row invariance and end-to-end greedy identity and speed. The real SmolLM2 weights
# (98 MB) cannot travel with the call: a SmolLM2-135M-shaped model with random weights stands in.
set -uo pipefail
export SPECULANT_NATIVE=off PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/cuda-check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 tools/random_smollm2.py /tmp/random-smollm2
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py -k cuda 2>&1 | tail -15
timeout 150 python3 -m speculant.bench.precisions --device cuda --model /tmp/random-smollm2 --rounds 20 \
    --max-width 16 2>&1 | tee "$OUT/precisions.md"
timeout 220 python3 -m speculant.bench.cuda_check --model /tmp/random-smollm2 \
    --draft-model speculant/data/drafts/smollm2-135m-instruct/draft_model 2>&1 | tee "$OUT/cuda_check.md"
