#!/usr/bin/env bash
# Set up .venv (reused on a rerun) and run the main job: a compressed save/load round trip.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python examples/roundtrip.py "$@"
