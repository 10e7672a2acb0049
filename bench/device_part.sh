# Sourced by the device scripts that run in parts (bench/device_final.sh, device_multigpu.sh, device_small_cards.sh,
# device_rescale.sh, device_e2e_033.sh, device_search.sh, device_search_model.sh, ...):
#   need_quality_carry             sets b=.carry/quality, or stops (exit 2) when the testbed was not carried
#   new_root DIR                   makes DIR afresh, sets root=DIR and PYTHONUNBUFFERED=1
#   record_gpu                     writes the GPUs (index, name, driver, memory) and the torch / Triton versions to
#                                  $root/gpu.txt and the log
#   part NAME SECONDS COMMAND...   runs COMMAND with OUT=$root/NAME under a time limit, its output in
#                                  $root/NAME/run.log, and prints the exit status and the log's tail; the caller
#                                  packs $root (the device returns at most 8 files).
need_quality_carry() {
  b=.carry/quality
  [ -f "$b/testbed/weights.safetensors" ] && return 0
  echo "no $b/testbed: run bench/quality_bundle.sh --no-sol and carry .carry/quality" >&2
  exit 2
}

new_root() {
  root=$1
  rm -rf "$root" && mkdir -p "$root"
  export PYTHONUNBUFFERED=1
}

record_gpu() {
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$root/gpu.txt"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 \
    | tail -n 1 | tee -a "$root/gpu.txt"
}

part() {
  local name=$1 secs=$2
  shift 2
  echo "=== $name (limit ${secs}s) $(date +%T)"
  mkdir -p "$root/$name"
  OUT=$root/$name timeout "$secs" "$@" > "$root/$name/run.log" 2>&1
  echo "=== $name exit $? $(date +%T)"
  tail -n 25 "$root/$name/run.log"
}
