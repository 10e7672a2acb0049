# Sourced by the bundle scripts (bench/device_bundle.sh, bench/quality_bundle.sh): wheels for the H200's
# Python 3.12 (manylinux x86_64), which has no package registry.
#   fetch_wheels DIR pkg==version ...   downloads the wheels (no dependencies) and unpacks them into DIR (a
#                                       site-packages folder for PYTHONPATH); comfy_kitchen's ROCm backend
#                                       (150 MB the H200 does not need) is left out.
fetch_wheels() {
  local dir=$1
  shift
  local whl
  whl=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$whl" "$@"
  mkdir -p "$dir"
  for w in "$whl"/*.whl; do (cd "$dir" && python3 -m zipfile -e "$w" .); done
  rm -rf "$whl" "$dir/comfy_kitchen/backends/hip"
}
