# Sourced by the device scripts (bench/device_final.sh, device_multigpu.sh, device_small_cards.sh):
#   part NAME SECONDS COMMAND...   runs COMMAND with OUT=$root/NAME under a time limit, its output in
#                                  $root/NAME/run.log, and prints the exit status and the log's tail; the caller
#                                  sets $root and packs it (the device returns at most 8 files).
part() {
  local name=$1 secs=$2
  shift 2
  echo "=== $name (limit ${secs}s) $(date +%T)"
  mkdir -p "$root/$name"
  OUT=$root/$name timeout "$secs" "$@" > "$root/$name/run.log" 2>&1
  echo "=== $name exit $? $(date +%T)"
  tail -n 25 "$root/$name/run.log"
}
