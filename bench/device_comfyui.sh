# Sourced by the device scripts that run ComfyUI (bench/device_e2e.sh, device_multigpu.sh, device_small_cards.sh):
#   unpack_comfyui BUNDLE   unpacks a bundle of bench/device_bundle.sh into /tmp/e2e and exports what running
#                           ComfyUI from it needs (PYTHONPATH, COMFYUI_PATH, the allocator ComfyUI would pick).
unpack_comfyui() {
  rm -rf /tmp/e2e && mkdir -p /tmp/e2e && tar xJf "$1" -C /tmp/e2e
  export PYTHONPATH=/tmp/e2e/site PYTHONUNBUFFERED=1 COMFYUI_PATH=/tmp/e2e/comfyui
  # comfy_api imports PyAV (video files) at import time; the device has none and no model here reads video
  python3 -c "import av" 2>/dev/null || cp -r bench/avstub/av /tmp/e2e/site/
  # ComfyUI's main.py selects this allocator on CUDA builds of torch (cuda_malloc.py); the benches do not run
  # main.py, so it is asked for here (set PYTORCH_CUDA_ALLOC_CONF to override)
  export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-backend:cudaMallocAsync}
}
