#!/usr/bin/env bash
# Set up .venv (reused on a rerun) and run the main job: `dcp-tiered demo` (train with three
# tiers and async saves, crash, resume, prove the restored state is bit-identical, summary).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/dcp-tiered demo "$@"
