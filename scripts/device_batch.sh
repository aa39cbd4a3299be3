#!/usr/bin/env bash
# Several GPU jobs in one device call (the device tool takes one command line of 2000 characters and gives 30 minutes
# a session): each step runs under its own time limit, its whole output goes to $OUT/<name>.log, and a table row
# (step, exit status, seconds, last line) is printed as it ends. A step that fails or times out does not stop the
# next one; a malformed steps file runs nothing.
#
#   OUT=$OUT bash scripts/device_batch.sh steps.txt
#
# steps.txt: one step a line, `name | seconds | command` (a shell command run from the repository root with
# PYTHONPATH=src); blank lines and lines starting with # are skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tritune-device-batch}; mkdir -p "$OUT"
steps=${1:?usage: OUT=DIR bash scripts/device_batch.sh STEPS_FILE}
[ -r "$steps" ] || { echo "device_batch.sh: cannot read $steps" >&2; exit 2; }
names=(); limits=(); cmds=()
n=0
while IFS= read -r line || [ -n "$line" ]; do  # every line checked before any step runs
    n=$((n + 1))
    [[ -z "${line// }" || "$line" =~ ^[[:space:]]*# ]] && continue
    IFS='|' read -r name limit cmd <<< "$line"
    name=$(echo "$name" | xargs); limit=$(echo "$limit" | xargs)
    if [[ ! "$name" =~ ^[A-Za-z0-9_.-]+$ || ! "$limit" =~ ^[0-9]+$ || -z "${cmd// }" ]]; then
        echo "device_batch.sh: $steps line $n: want 'name | seconds | command' (name of letters, digits, . _ -): $line" >&2
        exit 2
    fi
    names+=("$name"); limits+=("$limit"); cmds+=("$cmd")
done < "$steps"
echo "| step | exit | s | last line |"
echo "|---|---|---|---|"
for i in "${!names[@]}"; do
    start=$(date +%s)
    timeout "${limits[$i]}" bash -c "${cmds[$i]}" > "$OUT/${names[$i]}.log" 2>&1
    rc=$?
    took=$(( $(date +%s) - start ))
    last=$(tail -n 1 "$OUT/${names[$i]}.log" | cut -c1-100)
    echo "| ${names[$i]} | $rc$([ $rc -eq 124 ] && echo ' (timed out)') | $took | $last |"
done
