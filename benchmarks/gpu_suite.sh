#!/usr/bin/env bash
# The GPU suite in one command: GPU-relevant tests, host offload (states of 2**16, 2**18, 2**20
# and 2**22 points), per-layer checkpointing memory, the gradient and forward benchmarks against
# diffrax, and Lorenz ensembles (the fused kernel vs vmap, 2**3 .. 2**20 trajectories), within
# about 10 minutes, writing benchmarks/results/gpu-*.{json,md} with the device name.
# Without a GPU it exits with status 2 and says so; --cpu-smoke checks the orchestration on CPU.
# See benchmarks/gpu_suite.py for the steps and options.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" benchmarks/gpu_suite.py "$@"
