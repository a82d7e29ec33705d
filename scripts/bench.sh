#!/usr/bin/env bash
# Set everything up (scripts/setup.sh plus the `bench` extra: zipnn, psutil, matplotlib) and
# run the benchmarks one after another, each writing its sections of docs/benchmarks.md,
# its charts (docs/img/) and raw numbers (docs/bench_results/).
#   scripts/bench.sh                  # all of them, full size (33 min on 2 cores)
#   scripts/bench.sh codecs storage   # some of them
#   scripts/bench.sh --quick          # small smoke run of all, into /tmp/dcp-tiered-bench/
# Run it on a quiet machine: every table compares rows measured in the same run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/python -c "import zipnn, psutil, matplotlib" 2>/dev/null || .venv/bin/python -m pip install -q -e ".[bench]"
ALL=(codecs storage shards records scale s3 ranks async tiers broadcast replication goodput projection summary)
quick=()
names=()
for a in "$@"; do
  case "$a" in
    --quick) quick=(--quick); export DCP_TIERED_BENCH_DOC=${DCP_TIERED_BENCH_DOC:-/tmp/dcp-tiered-bench/benchmarks.md} ;;
    *) names+=("$a") ;;
  esac
done
[ ${#names[@]} -gt 0 ] || names=("${ALL[@]}")
for n in "${names[@]}"; do
  echo "=== benchmarks.bench_$n ${quick[*]:-}"
  start=$(date +%s)
  extra=()
  [ "$n" != replication ] || extra=(--write)  # bench_replication writes its section only when asked
  .venv/bin/python -m "benchmarks.bench_$n" "${quick[@]}" "${extra[@]}"
  echo "=== bench_$n took $(( $(date +%s) - start )) s"
done
