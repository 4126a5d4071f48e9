#!/usr/bin/env bash
# One poll of a background job on the GPU machine (tools/gpu_receipts.sh): waits until OUT_DIR/progress says "done"
# or SECONDS pass, then packs OUT_DIR into the device tool's $OUT as job.tgz and prints the progress and each log's
# tail. Issue the next poll as soon as one returns: the machine is handed back 30 s after a call ends, and the job
# dies with it (tools/gpu_receipts.sh's header). A machine without OUT_DIR/progress is a fresh one (the last was taken
# back): it says so and returns at once, costing no wait.
#
#   bash tools/device_poll.sh OUT_DIR SECONDS      # e.g. /root/job 540, in a call with a 600 s limit
set -u
job=${1:?usage: device_poll.sh OUT_DIR SECONDS}
limit=${2:?usage: device_poll.sh OUT_DIR SECONDS}
if [ ! -f "$job/progress" ]; then
  echo "no job on this machine: $job/progress is missing (a fresh machine?)"
  exit 3
fi
t0=$(date +%s)
while [ $(( $(date +%s) - t0 )) -lt "$limit" ] && ! grep -q " done" "$job/progress"; do
  sleep 10
done
if [ -n "${OUT:-}" ]; then
  tar -C "$(dirname "$job")" -czf "$OUT/job.tgz" "$(basename "$job")"
fi
cat "$job/progress"
echo ---
for f in "$job"/*.log; do
  [ -f "$f" ] || continue
  echo "== $f"
  tail -c 1500 "$f"
done | tail -c 9000
