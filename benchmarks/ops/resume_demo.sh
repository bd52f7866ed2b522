#!/usr/bin/env bash
# Matrix-level resume demonstration: kill Snakemake and its jobs with SIGKILL partway through a matrix,
# rerun the same command, and compare results/tables/summary.csv with an uninterrupted matrix.
#
#   bash benchmarks/ops/resume_demo.sh [PRESET] [KILL_AFTER_SECONDS]     (default: smoke 60)
#
# Both copies share one built toy model (copied in before they start), so the comparison is about the
# training jobs and the aggregation. Exit 0 and "identical" when the two summaries are byte-identical.
set -euo pipefail
preset=${1:-smoke}
kill_after=${2:-60}
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d /tmp/marlflow-resume.XXXX)
export PATH="$repo/.venv/bin:$PATH" HF_HUB_OFFLINE=1
snake=(snakemake --profile profiles/local --config preset="$preset")

for name in uninterrupted interrupted; do
    git -C "$repo" worktree add --detach -q "$work/$name" HEAD 2>/dev/null || cp -r "$repo" "$work/$name"
    rm -rf "$work/$name/results" && mkdir -p "$work/$name/results"
done
# Build the shared model once (in the uninterrupted copy) unless MODEL_DIR points at a built one, then give
# the other copy the same files.
if [ -n "${MODEL_DIR:-}" ]; then
    mkdir -p "$work/uninterrupted/results/models" && cp -r "$MODEL_DIR" "$work/uninterrupted/results/models/toy"
else
    (cd "$work/uninterrupted" && "${snake[@]}" results/models/toy >/dev/null 2>&1)
fi
cp -r "$work/uninterrupted/results/models" "$work/interrupted/results/"
touch "$work/interrupted/results/models/toy/READY"

start=$(date +%s)
(cd "$work/uninterrupted" && "${snake[@]}" >"$work/uninterrupted.log" 2>&1)
echo "uninterrupted matrix: $(($(date +%s) - start)) s"

cd "$work/interrupted"
setsid "${snake[@]}" >"$work/interrupted-1.log" 2>&1 &
leader=$!
sleep "$kill_after"
kill -KILL -- "-$leader" 2>/dev/null || true # the whole process group: snakemake and every job
wait "$leader" 2>/dev/null || true
echo "killed after ${kill_after}s; finished runs then: $(ls results/runs/*/DONE 2>/dev/null | wc -l)," \
    "checkpoints: $(ls -d results/runs/*/checkpoints/step-* 2>/dev/null | wc -l)"
# A SIGKILLed Snakemake cannot remove its lock; --unlock clears it (jobs' own outputs are untouched).
"${snake[@]}" --unlock >/dev/null 2>&1
"${snake[@]}" >"$work/interrupted-2.log" 2>&1
echo "rerun: $(grep -c 'rule train:' "$work/interrupted-2.log" || true) train jobs scheduled"

if cmp -s "$work/uninterrupted/results/tables/summary.csv" results/tables/summary.csv; then
    echo "summary.csv identical ($work)"
else
    diff "$work/uninterrupted/results/tables/summary.csv" results/tables/summary.csv || true
    echo "summary.csv DIFFERS ($work)" >&2
    exit 1
fi
