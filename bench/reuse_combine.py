"""How should a reuse step combine its fresh sparse output with what the anchor cached? An exact study on the
quality testbed (docs/quality.md), before any kernel is changed.

    python bench/reuse_combine.py --testbed .carry/quality/testbed --out DIR [--methods block_topk,mc_sparse]
        [--densities 0.1,0.15] [--schedules "w2 a2,10;a0;w2 a2,6,14"] [--modes add,lse,merge] [--steps 30]

Per row of a query and the KV set S an anchor selected (C its complement), with Z_X the softmax mass of X and
beta = Z_C / (Z_S + Z_C):

    dense = sparse + beta * (O_C - O_S) = sparse + R          (R the residual the engine caches today)

A reuse step t computes O_S(t) and, for free inside the kernel, LSE_S(t). Three ways to finish it:

- ``add``   (the engine today): O_S(t) + R(anchor). Assumes beta did not move since the anchor.
- ``lse``:  O_S(t) + beta'(t) / beta(anchor) * R(anchor), beta'(t) = Z_C(anchor) / (Z_S(t) + Z_C(anchor)): the
  complement's share re-weighted by the sparse mass measured now (one fp32 per row more in the cache).
- ``merge``: (1 - beta'(t)) O_S(t) + beta'(t) O_C(anchor): the cached complement merged as a stale partial
  attention (flash-decoding's merge).

Everything here is exact fp32 PyTorch on the engine's own selections (its policies choose S at the anchors), so the
rows compare the combining rules alone: no kernel, no fp8. Each reuse call also reports every rule's relative L2
error against the true dense output of that call (the trajectory follows the row's own rule). Writes
DIR/reuse_combine.json and DIR/reuse_combine.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from _pack import load
from quality import build_model, load_testbed, versions

MODES = ("add", "lse", "merge")
Q_CHUNK = 4096  # query rows of one (batch, head) scored at a time: 4096 x N fp32 scores


def say(msg: str) -> None:
    print(f"[reuse] {msg}", flush=True)


def parse_schedule(text: str) -> tuple[int, list[int]]:
    """'w2 a2,10' -> (2, [2, 10]); 'a0' -> (0, [0]). ValueError on anything else."""
    warm, anchors = 0, None
    for part in text.split():
        if part.startswith("w"):
            warm = int(part[1:])
        elif part.startswith("a"):
            anchors = [int(x) for x in part[1:].split(",") if x]
        else:
            raise ValueError(f"schedule {text!r}: parts are wN and aN,M,..")
    if not anchors:
        raise ValueError(f"schedule {text!r}: needs anchors (aN,..)")
    if anchors[0] < warm:
        raise ValueError(f"schedule {text!r}: the first anchor comes after the warm-up")
    return warm, anchors


def selection_mask(sel, n: int):
    """The engine's selection as a bool mask callable: rows(b, h, r0, r1) -> (r1 - r0, n) keep mask of those query
    rows. BlockSelection: the rows' block's listed KV blocks; TokenSelection: the row's group's listed tokens (rows in
    no group keep nothing)."""
    import torch
    if hasattr(sel, "kv_indices"):
        idx, cnt = sel.kv_indices.long(), sel.kv_counts.long()
        b, h, nqb, w = idx.shape
        nkb = -(-n // sel.block_k)
        valid = torch.arange(w, device=idx.device).view(1, 1, 1, w) < cnt.unsqueeze(-1)
        blocks = torch.zeros(b, h, nqb, nkb + 1, dtype=torch.bool, device=idx.device)
        blocks.scatter_(3, torch.where(valid, idx, nkb), True)
        blocks = blocks[..., :nkb]

        def rows(bi, hi, r0, r1):
            qb = torch.arange(r0, r1, device=idx.device) // sel.block_q
            return blocks[bi, hi, qb].repeat_interleave(sel.block_k, dim=-1)[:, :n]
        return rows
    toks, cnt, groups = sel.kv_tokens().long(), sel.kv_counts.long(), sel.q_groups.long()
    b, h, g, w = toks.shape
    valid = torch.arange(w, device=toks.device).view(1, 1, 1, w) < cnt.unsqueeze(-1)
    keep = torch.zeros(b, h, g + 1, n + 1, dtype=torch.bool, device=toks.device)
    keep[:, :, :g].scatter_(3, torch.where(valid, toks, n), True)
    keep = keep[..., :n]
    group_of = torch.full((b, h, n), g, dtype=torch.long, device=toks.device)  # g: the empty row
    gid = torch.arange(g, device=toks.device).view(1, 1, g, 1).expand_as(groups)
    ok = groups >= 0
    group_of.view(b * h, n).scatter_(1, torch.where(ok, groups, 0).view(b * h, -1),
                                     torch.where(ok, gid, g).view(b * h, -1))
    if sel.dense_rows is not None and sel.dense_rows.numel():
        raise ValueError("selections with dense (text) rows are not supported here")

    def rows(bi, hi, r0, r1):
        return keep[bi, hi, group_of[bi, hi, r0:r1]]
    return rows


def attend(q, k, v, mask_rows=None):
    """Exact fp32 attention of (B, H, N, D) inputs, scale 1/sqrt(D): (out_dense, lse_dense) and, with ``mask_rows``,
    also (out_sparse, lse_sparse) over the kept keys (empty rows: out 0, lse -inf). One score matrix per chunk of
    query rows serves both: exp(s - rowmax) once, masked in place for the sparse sums."""
    import torch
    b, h, n, d = q.shape
    scale = d ** -0.5
    od = torch.empty(b, h, n, d, dtype=torch.float32, device=q.device)
    ld = torch.empty(b, h, n, dtype=torch.float32, device=q.device)
    os_ = torch.empty_like(od) if mask_rows else None
    ls = torch.empty_like(ld) if mask_rows else None
    for bi in range(b):
        for hi in range(h):
            kk, vv = k[bi, hi].float(), v[bi, hi].float()
            for r0 in range(0, n, Q_CHUNK):
                r1 = min(n, r0 + Q_CHUNK)
                e = (q[bi, hi, r0:r1].float() @ kk.T).mul_(scale)
                m = e.amax(-1, keepdim=True)
                e.sub_(m).exp_()
                z = e.sum(-1)
                ld[bi, hi, r0:r1] = m.squeeze(-1) + z.log()
                od[bi, hi, r0:r1] = (e @ vv) / z.unsqueeze(-1)
                if mask_rows:
                    e.masked_fill_(~mask_rows(bi, hi, r0, r1), 0.0)
                    zs = e.sum(-1)
                    ls[bi, hi, r0:r1] = m.squeeze(-1) + zs.log()  # -inf where nothing is kept
                    os_[bi, hi, r0:r1] = (e @ vv) / zs.clamp(min=1e-30).unsqueeze(-1)
    return (od, ld, os_, ls) if mask_rows else (od, ld)


def complement(od, ld, os_, ls):
    """Anchor cache of one call: R = dense - sparse, the complement's LSE and beta (its mass share), and O_C."""
    import torch
    frac = torch.exp(ls - ld).clamp(max=1.0)           # sparse share of the mass; 0 for empty rows
    beta = (1.0 - frac).clamp(min=0.0)
    lc = ld + torch.log(beta.clamp(min=1e-30))          # log Z_C
    r = od - os_
    oc = torch.where((beta > 1e-6).unsqueeze(-1), os_ + r / beta.clamp(min=1e-6).unsqueeze(-1), od)
    return dict(r=r, lc=lc, beta=beta, oc=oc)


def combine(mode, cache, os_, ls):
    """A reuse call's output under ``mode`` from its sparse output/LSE and the anchor's cache."""
    import torch
    if mode == "add":
        return os_ + cache["r"]
    beta_now = torch.sigmoid(cache["lc"] - ls)          # Z_C(anchor) / (Z_S(now) + Z_C(anchor)); 1 for empty rows
    if mode == "lse":
        w = torch.where(cache["beta"] > 1e-6, beta_now / cache["beta"].clamp(min=1e-6), 1.0)
        return os_ + w.unsqueeze(-1) * cache["r"]
    if mode == "merge":
        return (1 - beta_now).unsqueeze(-1) * os_ + beta_now.unsqueeze(-1) * cache["oc"]
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


class CombineAttention:
    """The testbed's attention(q, k, v): dense at warm-up steps, an exact anchor (the engine's policy selects) at
    anchor steps, ``mode`` at every other step; per reuse call the relative L2 error of every mode."""

    def __init__(self, method, density, size, warm, anchors, mode, context):
        import torch
        eng, self.ld = load("engine"), load("engine.layer_density")
        self.cfg = eng.SparseConfig.from_dict(dict(method=method, density=density, block_q=size, block_k=size,
                                                   group_size=size, residual=True, min_tokens=0, backend="torch"),
                                              source="reuse_combine")
        self.policy = load("engine.policy").policy_for(method)
        self.layout_cls = eng.TokenLayout
        self.warm, self.anchors, self.mode, self.context = warm, anchors, mode, context
        self.cache, self.errors, self.torch = {}, {m: [] for m in MODES}, torch

    def __call__(self, q, k, v):
        torch, c = self.torch, self.context
        step, key = c["step"], (c["layer"], c.get("batch_offset", 0))
        if step < self.warm:
            return attend(q, k, v)[0].to(q.dtype)
        n = q.shape[2]
        if step in self.anchors or key not in self.cache:
            layout = self.layout_cls(grid=tuple(c["grid"]))
            lse = attend(q, k, v)[1] if self.policy.needs_lse else None
            sel = self.ld.select_heads(self.policy, q, k, lse, layout, self.cfg, None, scale=q.shape[-1] ** -0.5,
                                       backend="torch")
            mask = selection_mask(sel, n)
            od, ld, os_, ls = attend(q, k, v, mask)
            self.cache[key] = dict(mask=mask, **complement(od, ld, os_, ls))
            return od.to(q.dtype)
        entry = self.cache[key]
        od, _, os_, ls = attend(q, k, v, entry["mask"])
        norm = float(torch.linalg.vector_norm(od))
        for m in MODES:
            self.errors[m].append(float(torch.linalg.vector_norm(combine(m, entry, os_, ls) - od)) / max(norm, 1e-30))
        return combine(self.mode, entry, os_, ls).to(q.dtype)


def run(args) -> dict:
    import torch
    t0 = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.backends.cuda.matmul.allow_tf32 = bool(args.tf32)
    ev = load_testbed(args.testbed, need_weights=not args.random_init_small)
    net = build_model(ev, args.testbed, args.random_init_small, device)
    if args.video:  # another video size than the training one (the grid follows the input; CPU checks)
        net.cfg.frames, net.cfg.height, net.cfg.width = (int(x) for x in args.video.split(","))
    seeds = [int(s) for s in args.seeds.split(",")]
    noise = ev.make_noise(net.cfg, seeds)
    labels = torch.tensor([s % net.cfg.num_classes for s in seeds], dtype=torch.long)

    def sample(attn):
        return ev.sample(net, noise, labels, steps=args.steps, shift=args.shift, batch=args.batch, attn=attn,
                         device=device)
    ref = sample(ev.M.sdpa_attention)
    say(f"{math.prod(net.cfg.grid)} tokens, {len(seeds)} videos, {args.steps} steps on {device}: reference in "
        f"{time.perf_counter() - t0:.1f} s")
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for method in args.methods.split(","):
        for density in (float(d) for d in args.densities.split(",")):
            for sched in args.schedules.split(";"):
                warm, anchors = parse_schedule(sched.strip())
                for mode in args.modes.split(","):
                    if time.perf_counter() - t0 > args.budget_s:
                        say(f"budget: skipped {method} {density} {sched} {mode}")
                        continue
                    t = time.perf_counter()
                    attn = CombineAttention(method, density, args.size, warm, anchors, mode, ev.M.CONTEXT)
                    video = sample(attn)
                    p = ev.psnr(video, ref)
                    errs = {m: sum(e) / len(e) if e else None for m, e in attn.errors.items()}
                    rows.append(dict(method=method, density=density, schedule=sched.strip(), mode=mode,
                                     psnr_mean=sum(p) / len(p), psnr_min=min(p), psnr=p, reuse_rel_l2=errs,
                                     seconds=time.perf_counter() - t))
                    say(f"{method} d{density} {sched.strip():12s} {mode:5s}: PSNR {sum(p) / len(p):6.2f} dB "
                        f"(min {min(p):.2f}); mean reuse rel-L2 " + ", ".join(
                            f"{m} {e:.4f}" for m, e in errs.items() if e is not None))
                    doc = dict(meta=dict(command="python bench/reuse_combine.py " + " ".join(sys.argv[1:]),
                                         device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                                         versions=versions(), date=time.strftime("%Y-%m-%d %H:%M"),
                                         tokens=math.prod(net.cfg.grid), seeds=seeds, steps=args.steps,
                                         size=args.size, wall_s=round(time.perf_counter() - t0, 1)), rows=rows)
                    (out / "reuse_combine.json").write_text(json.dumps(doc, indent=1))
    (out / "reuse_combine.md").write_text(table(rows))
    print(table(rows))
    return doc


def table(rows) -> str:
    lines = ["| method | density | schedule | mode | PSNR dB mean (min) | reuse rel-L2 add / lse / merge |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        e = r["reuse_rel_l2"]
        lines.append(f"| {r['method']} | {r['density']} | {r['schedule']} | {r['mode']} | {r['psnr_mean']:.2f} "
                     f"({r['psnr_min']:.2f}) | " + " / ".join("–" if e[m] is None else f"{e[m]:.4f}" for m in MODES)
                     + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--testbed", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--methods", default="block_topk,mc_sparse")
    ap.add_argument("--densities", default="0.1,0.15")
    ap.add_argument("--schedules", default="w2 a2,10;a0", help="';'-separated: wN (dense warm-up) aN,M (anchors)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--size", type=int, default=64, help="blocks (block_topk) and query groups (mc_sparse)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--shift", type=float, default=3.0)
    ap.add_argument("--seeds", default="0,1,2,3,4,5,6,7")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--video", default="", help="F,H,W pixels instead of the testbed's size (e.g. 8,64,64 on a CPU)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--tf32", action="store_true", help="TF32 matmuls for the exact attention (GPU; ~1e-3 relative)")
    ap.add_argument("--random-init-small", action="store_true", help="the testbed's tiny random model (a wiring check)")
    run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
