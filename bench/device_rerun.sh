#!/usr/bin/env bash
# Issue 14's re-runs on today's kernels, in parts (carry: [".carry/bundle.tar.xz"] from bench/device_bundle.sh for
# every part but "kernels"). PARTS names them, in order (default all):
#   kernels        bench/kernels.py at Wan 14B, HunyuanVideo and Wan 1.3B: block-sparse 128 at d 0.5 / 0.25 / 0.1
#                  against cuDNN and FlexAttention, token-sparse, pass 2 (KERNELS_S, default 200)
#   hyv-quality    HunyuanVideo with the hunyuan_video_quality preset, anchor / reuse / anchor / reuse timed, its
#                  dense step from HYV_DENSE (an e2e.json of an earlier run) (HYV_Q_S, 260)
#   wan14b-methods Wan 2.1 14B with mc_sparse 0.1 and ComfyUI's Sol-Attn 0.1 under the model's preset schedule, the
#                  same pattern; dense from WAN14B_DENSE
#                  (METHODS_S, 260)
#   wan14b-quality Wan 2.1 14B with the wan21_t2v_14b_quality preset, the same pattern and dense (WAN14B_Q_S, 200)
#   mc-memory      (named only) Wan 2.1 14B with mc_sparse 0.1 alone, the same pattern and dense, every self-attention
#                  call's allocated memory and cache bytes logged (bench/e2e.py --trace-memory): what the second
#                  anchor holds beyond the cache (docs/benchmarks.md, "Issue 14's re-runs on the H200") (MEM_S, 240);
#                  PYTORCH_CUDA_ALLOC_CONF=backend:native runs it on the native allocator instead of cudaMallocAsync
#   mc-hyv         (named only) HunyuanVideo with mc_sparse 0.1, the same pattern, dense from HYV_DENSE (MC_HYV_S, 200)
#   mc-wan13b      (named only) Wan 2.1 1.3B with mc_sparse 0.1, the same pattern, dense from WAN13B_DENSE (MC13_S, 120)
#   token-tests    (named only) the Gluon token kernel's GPU tests, its own grid and the persistent one (TOKEN_TESTS_S,
#                  150; TOKEN_TESTS_K: another pytest -k)
#   token-grids    (named only) bench/kernels.py --token-only --token-grids at Wan 1.3B, Wan 14B and HunyuanVideo: the
#                  token kernel on both grids, int32 lists and the engine's compact lists with an fp8 residual (GRIDS_S, 150)
# The dense steps default by card to this repository's runs on the same kind of card (dense_for); measured where none.
# BUNDLE names another bundle for the model runs (e.g. one without comfy-kitchen, where no part runs Sol-Attn, to
# leave room in the carry for .carry/quality).
# Results under $OUT/rerun/<part>/, packed into $OUT/rerun.tar.gz.
#   [PARTS="kernels hyv-quality"] bash bench/device_rerun.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
new_root /tmp/rerun
record_gpu
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1)
dense_for() {  # dense_for MODEL: an earlier e2e.json with MODEL's dense rows, timed on this kind of card ("" = measure)
  case "$gpu:$1" in
    *H200*:wan14b) echo docs/bench-runs/rerun-h200-1/wan14b-methods/e2e.json ;;
    *H200*:hyv) echo docs/bench-runs/rerun-h200-1/hyv-quality/e2e.json ;;
    *H200*:wan13b) echo docs/bench-runs/replay-1/e2e-wan13b-off/e2e.json ;;
    *H100*:wan14b) echo docs/bench-runs/gluon-e2e-1/gluon/e2e.json ;;
    *H100*:wan13b) echo docs/bench-runs/whole-gluon-1/e2e-wan13b/e2e.json ;;
  esac
}
WAN14B_DENSE=${WAN14B_DENSE-$(dense_for wan14b)}
HYV_DENSE=${HYV_DENSE-$(dense_for hyv)}
WAN13B_DENSE=${WAN13B_DENSE-$(dense_for wan13b)}
e2e=(env BUNDLE="${BUNDLE:-.carry/bundle.tar.xz}" bash bench/device_e2e.sh --pattern ArAr --total-steps 30 --log-compiles)
for p in ${PARTS:-kernels hyv-quality wan14b-methods wan14b-quality}; do
  case $p in
    kernels) part kernels "${KERNELS_S:-200}" python3 bench/kernels.py --out "$root/kernels" \
      --shapes wan14b,hyv,wan13b --densities 0.5,0.25,0.1 --block-sizes 128 ;;
    hyv-quality) part hyv-quality "${HYV_Q_S:-260}" "${e2e[@]}" --models hyv --preset hunyuan_video_quality \
      --modes block_topk@0.15 ${HYV_DENSE:+--reuse-dense "$HYV_DENSE"} ;;
    wan14b-methods) part wan14b-methods "${METHODS_S:-260}" "${e2e[@]}" --models wan14b --modes mc_sparse@0.1,sol@0.1 \
      ${WAN14B_DENSE:+--reuse-dense "$WAN14B_DENSE"} ;;
    wan14b-quality) part wan14b-quality "${WAN14B_Q_S:-200}" "${e2e[@]}" --models wan14b --preset wan21_t2v_14b_quality \
      --modes block_topk@0.15 ${WAN14B_DENSE:+--reuse-dense "$WAN14B_DENSE"} ;;
    mc-memory) part mc-memory "${MEM_S:-240}" "${e2e[@]}" --models wan14b --modes mc_sparse@0.1 --trace-memory \
      ${WAN14B_DENSE:+--reuse-dense "$WAN14B_DENSE"} ;;
    mc-hyv) part mc-hyv "${MC_HYV_S:-200}" "${e2e[@]}" --models hyv --modes mc_sparse@0.1 \
      ${HYV_DENSE:+--reuse-dense "$HYV_DENSE"} ;;
    mc-wan13b) part mc-wan13b "${MC13_S:-120}" "${e2e[@]}" --models wan13b --modes mc_sparse@0.1 \
      ${WAN13B_DENSE:+--reuse-dense "$WAN13B_DENSE"} ;;
    token-tests) part token-tests "${TOKEN_TESTS_S:-150}" python3 -m pytest -q -rs -m gpu tests/test_gpu_kernels.py \
      -p no:cacheprovider -k "${TOKEN_TESTS_K:-gluon_token}" ;;
    token-grids) part token-grids "${GRIDS_S:-150}" python3 bench/kernels.py --out "$root/token-grids" \
      --shapes wan13b,wan14b,hyv --token-only --token-grids ;;
    *) echo "unknown part $p" >&2 ;;
  esac
done
tar czf "$OUT/rerun.tar.gz" -C /tmp rerun
ls -la "$OUT"
