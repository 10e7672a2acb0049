#!/usr/bin/env bash
# Issue 14's re-runs on today's kernels, in parts (carry: [".carry/bundle.tar.xz"] from bench/device_bundle.sh for
# every part but "kernels"). PARTS names them, in order (default all):
#   kernels        bench/kernels.py at Wan 14B, HunyuanVideo and Wan 1.3B: block-sparse 128 at d 0.5 / 0.25 / 0.1
#                  against cuDNN and FlexAttention, token-sparse, pass 2 (KERNELS_S, default 200)
#   hyv-quality    HunyuanVideo with the hunyuan_video_quality preset, anchor / reuse / anchor / reuse timed, its
#                  dense step from HYV_DENSE (an e2e.json of an earlier run; default measured here) (HYV_Q_S, 260)
#   wan14b-methods Wan 2.1 14B with mc_sparse 0.1 and ComfyUI's Sol-Attn 0.1 under the model's preset schedule, the
#                  same pattern; dense from WAN14B_DENSE (default measured here)
#                  (METHODS_S, 260)
#   wan14b-quality Wan 2.1 14B with the wan21_t2v_14b_quality preset, the same pattern and dense (WAN14B_Q_S, 200)
#   mc-memory      (named only) Wan 2.1 14B with mc_sparse 0.1 alone, the same pattern and dense, every self-attention
#                  call's allocated memory and cache bytes logged (bench/e2e.py --trace-memory): what the second
#                  anchor holds beyond the cache (docs/benchmarks.md, "Issue 14's re-runs on the H200") (MEM_S, 240)
# Results under $OUT/rerun/<part>/, packed into $OUT/rerun.tar.gz.
#   [PARTS="kernels hyv-quality"] bash bench/device_rerun.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_part.sh
new_root /tmp/rerun
record_gpu
e2e=(env BUNDLE=.carry/bundle.tar.xz bash bench/device_e2e.sh --pattern ArAr --total-steps 30 --log-compiles)
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
    *) echo "unknown part $p" >&2 ;;
  esac
done
tar czf "$OUT/rerun.tar.gz" -C /tmp rerun
ls -la "$OUT"
