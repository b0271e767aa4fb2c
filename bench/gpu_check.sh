#!/usr/bin/env bash
# GPU check, for a machine with a CUDA GPU and CuPy already installed (this script installs nothing).
# 1. the reference-parity and resident-form tests on device="gpu" (tests/test_gpu.py);
# 2. the K3-shapes benchmark on the GPU (recorder on), table printed, JSON in bench/results/;
# 3. bench/mapped_experts.py on the GPU (experts="mapped" vs "packed").
# A few minutes: the synthetic K3-shaped checkpoints (5.8 GB for k3_shapes, 2.1 GB for mapped_experts) are written once, then each layer is
# loaded alone. Usage: bench/gpu_check.sh [extra k3_shapes.py args]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

python - <<'PY'
import sys
from kimi_explore.backend import _cupy_status
cupy, why = _cupy_status()
if cupy is None:
    sys.exit(f"gpu_check: no usable GPU: {why}")
props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
free, total = cupy.cuda.runtime.memGetInfo()
print(f"gpu_check: {props['name'].decode()}, {total / 2**30:.0f} GiB ({free / 2**30:.0f} free), CuPy {cupy.__version__}")
PY

timeout 300 python -m pytest -q -m gpu -rs tests/test_gpu.py
timeout 480 python bench/k3_shapes.py --device gpu --recorder --tokens 8 --layers 0,1,3 \
    --weight-dtype float32,bfloat16 --json bench/results/k3_shapes_gpu.json "$@"
# 3. mapped experts copied to the device per use (selected only) vs packed bytes resident on it: warm and cold
timeout 300 python bench/mapped_experts.py --device gpu --tokens 4 --json bench/results/mapped_experts_gpu.json
