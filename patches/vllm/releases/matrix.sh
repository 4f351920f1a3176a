#!/usr/bin/env bash
# Run `make test-vllm` for each release given (default: 0.29 0.30 0.31 0.32), one after
# another, and print one table: release, passed/failed/skipped/errors, minutes.
# Each release's output is kept in .venv-vllm-logs/<release>.log. Exit status: 1 if any failed.
set -uo pipefail
releases=${*:-0.29 0.30 0.31 0.32}
logs=.venv-vllm-logs
mkdir -p "$logs"
rows=() status=0
for release in $releases; do
    start=$(date +%s)
    make --no-print-directory test-vllm VLLM="$release" 2>&1 | tee "$logs/$release.log"
    rc=${PIPESTATUS[0]}
    minutes=$(awk -v s="$(( $(date +%s) - start ))" 'BEGIN { printf "%.1f", s / 60 }')
    # pytest's last line: "==== 40 passed, 1 skipped, 2 failed in 512.3s (0:08:32) ===="
    summary=$(grep -E '^=+ .*(passed|failed|error|skipped|no tests ran).* in [0-9.]+s' "$logs/$release.log" | tail -1)
    count() { grep -oE "[0-9]+ $1" <<<"$summary" | grep -oE '^[0-9]+' || echo 0; }
    [ "$rc" = 0 ] || status=1
    rows+=("$(printf '| %-7s | %6s | %6s | %7s | %6s | %7s | %s |' "$release" "$(count passed)" "$(count failed)" \
        "$(count skipped)" "$(count error)" "$minutes" "$([ "$rc" = 0 ] && echo ok || echo "FAILED (rc $rc)")")")
done
echo
echo "| release | passed | failed | skipped | errors | minutes | result |"
echo "|---------|--------|--------|---------|--------|---------|--------|"
printf '%s\n' "${rows[@]}"
exit $status
