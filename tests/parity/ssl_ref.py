"""lightly's SSL losses as the reference for trainscope's objectives, on the same tensors.

An SSL cell's parity dump carries `ssl_losses` (suites/ssl/methods.cpp loss_probe): fixed inputs for
each objective, the loss trainscope computed and its gradients. Here lightly 1.6.0 computes the same:
`NTXentLoss` (also as rank 0 and rank 1 of 2 on a gathered batch), `NegativeCosineSimilarity` in BYOL's
symmetrised form, `DINOLoss` with its centre update, and MAE's masked-patch MSE as the MAE authors'
`forward_loss` writes it (lightly has no MAE loss class: its examples use `MSELoss` on the masked
patches, checked too). Where the two sides sum in another order the tolerance is the rounding bound of
that reordering, derived below; where they agree to the bit the verdict says so.
"""
from unittest import mock

import torch

lightly = None  # imported on first use


def _load():
    global lightly
    if lightly is None:
        try:
            import lightly as module
            import lightly.loss  # noqa: F401
            import lightly.utils.dist  # noqa: F401
        except ImportError:
            return None
        lightly = module
    return lightly


def available():
    return _load() is not None


def version():
    return _load().__version__


U = 2.0 ** -24  # fp32 unit roundoff


def reorder_bound(terms, magnitude):
    """Two fp32 sums of the same `terms` numbers of size at most `magnitude`, in different orders,
    differ by at most 2 (terms - 1) u magnitude (each is within (terms - 1) u sum|x| of the exact sum)."""
    return 2 * (terms - 1) * U * magnitude


def row(cell, dump, dump_path, lib):
    import reference as ref
    lib_ = _load()
    p = {k: v for k, v in dict(dump["ssl_losses"]).items()}
    checks = []

    def scalar(name, ours, theirs, tol, why):
        a, b = float(torch.as_tensor(ours).detach()), float(torch.as_tensor(theirs).detach())
        out = {"name": name, "trainscope": a, "pytorch": b, "difference": abs(a - b)}
        if a == b:
            out.update(verdict="exact", tolerance=0.0)
        else:
            out.update(verdict="within" if abs(a - b) <= tol else "differs", tolerance=tol, tolerance_from=why)
        return out

    # ---- SimCLR: NT-Xent over 2N anchors, 2M - 1 candidates each --------------------------------
    t = float(p["simclr.temperature"])
    z1, z2 = p["simclr.z1"].clone().requires_grad_(), p["simclr.z2"].clone().requires_grad_()
    loss = lib_.loss.NTXentLoss(temperature=t)(z1, z2)
    loss.backward()
    n = z1.shape[0]
    # Each anchor's log-sum-exp runs over 2n columns (ours keeps the anchor itself at -1e9, whose exp is
    # 0; lightly drops it and orders the columns [l01 | l00]); the mean then sums 2n anchors. Logits are
    # at most 1/t in size, the loss at most 2/t + ln(2n).
    mag = 2 / t + float(torch.log(torch.tensor(2.0 * n)))
    why = f"2(k-1)u x {mag:.3g} for k = {4 * n} terms: the log-sum-exp and the mean summed in another order"
    checks.append(scalar("NT-Xent loss (lightly NTXentLoss)", p["simclr.loss"], loss, reorder_bound(4 * n, mag), why))
    gmag = 2 / (t * n)  # d loss / d z is at most (2/t) / (2n) per anchor, counted from both sides
    checks.append(ref.tensor_check("NT-Xent gradients", {"z1": p["simclr.grad_z1"], "z2": p["simclr.grad_z2"]},
                                   {"z1": z1.grad, "z2": z2.grad}, reorder_bound(4 * n, gmag),
                                   f"2(k-1)u x {gmag:.3g} (the largest gradient, 2/(t n)) for k = {4 * n}"))
    # The same on a batch gathered from 2 ranks: lightly's gather, rank and world size answered as
    # rank r of 2 would see them (its GatherLayer needs a process group only for the exchange itself).
    views = {0: (p["simclr.z1"], p["simclr.z2"]), 1: (p["simclr.rank1_z1"], p["simclr.rank1_z2"])}
    for r in (0, 1):
        dist, calls = lib_.utils.dist, []

        def gather(x, r=r, calls=calls):  # lightly gathers the normalised first view, then the second
            i = len(calls)
            calls.append(i)
            return [x if q == r else torch.nn.functional.normalize(views[q][i], dim=1) for q in (0, 1)]

        with mock.patch.object(dist, "world_size", lambda: 2), mock.patch.object(dist, "rank", lambda r=r: r), \
                mock.patch.object(dist, "gather", gather):
            theirs = lib_.loss.NTXentLoss(temperature=t, gather_distributed=True)(*views[r])
        checks.append(scalar(f"NT-Xent loss on 2 ranks' gathered batch, rank {r}", p[f"simclr.gathered_loss_rank{r}"],
                             theirs, reorder_bound(8 * n, mag), why.replace(str(4 * n), str(8 * n))))

    # ---- BYOL: trainscope sums 2 - 2cos over both directions; lightly's symmetrised form is
    # 0.5 (-cos(p0, z1) - cos(p1, z0)), so ours = 4 + 4 x lightly's, up to the order of the means -----
    p0, p1 = p["byol.p0"].clone().requires_grad_(), p["byol.p1"].clone().requires_grad_()
    crit = lib_.loss.NegativeCosineSimilarity()
    sym = 0.5 * (crit(p0, p["byol.z1"]) + crit(p1, p["byol.z0"]))
    sym.backward()
    n = p0.shape[0]
    checks.append(scalar("BYOL loss against 4 + 4 x lightly's symmetrised NegativeCosineSimilarity", p["byol.loss"],
                         4 + 4 * sym.item(), reorder_bound(2 * n, 4.0),
                         f"2(k-1)u x 4 for k = {2 * n}: ours averages 2 - 2cos per sample, lightly averages cos"))
    checks.append(ref.tensor_check("BYOL gradients (4 x lightly's)", {"p0": p["byol.grad_p0"], "p1": p["byol.grad_p1"]},
                                   {"p0": 4 * p0.grad, "p1": 4 * p1.grad}, reorder_bound(2, 4.0 / n),
                                   f"one reordered product per element, gradients at most 4/n = {4.0 / n:.3g}"))

    # ---- DINO: the loss over the pairs of different views and the centre after the step ---------------
    s0, s1 = p["dino.s0"].clone().requires_grad_(), p["dino.s1"].clone().requires_grad_()
    k = s0.shape[1]
    dino = lib_.loss.DINOLoss(output_dim=k, warmup_teacher_temp=float(p["dino.teacher_temp"]),
                              teacher_temp=float(p["dino.teacher_temp"]), warmup_teacher_temp_epochs=0,
                              student_temp=float(p["dino.student_temp"]), center_momentum=float(p["dino.center_momentum"]))
    with torch.no_grad():
        dino.center.copy_(p["dino.center"].reshape(1, 1, k))
    loss = dino(teacher_out=[p["dino.t0"], p["dino.t1"]], student_out=[s0, s1],
                teacher_temp=float(p["dino.teacher_temp"]))
    loss.backward()
    n = s0.shape[0]
    # A cross-entropy term is at most log k + |s|/student_temp; lightly sums the 2 pairs' k x n
    # products in one einsum, ours per pair over k then the mean over n.
    mag = float(torch.log(torch.tensor(float(k)))) + float(max(s0.detach().abs().max(), s1.detach().abs().max())) / float(p["dino.student_temp"])
    checks.append(scalar("DINO loss (lightly DINOLoss)", p["dino.loss"], loss, reorder_bound(2 * k * n, mag),
                         f"2(k-1)u x {mag:.3g} for k = {2 * k * n} products summed in another order"))
    gmag = 2.0 / (n * float(p["dino.student_temp"]))
    checks.append(ref.tensor_check("DINO gradients", {"s0": p["dino.grad_s0"], "s1": p["dino.grad_s1"]},
                                   {"s0": s0.grad, "s1": s1.grad}, reorder_bound(2 * k, gmag),
                                   f"2(k-1)u x {gmag:.3g} (2/(n student_temp)) for k = {2 * k}"))
    tmag = float(max(p["dino.t0"].abs().max(), p["dino.t1"].abs().max()))
    checks.append(ref.tensor_check("DINO centre after the step", {"center": p["dino.center_after"]},
                                   {"center": dino.center.reshape(1, k)}, reorder_bound(2 * n, tmag),
                                   f"2(k-1)u x {tmag:.3g} for the k = {2 * n} teacher outputs averaged per prototype "
                                   "(ours over the concatenated views, lightly over views and batch)"))

    # ---- MAE: the authors' forward_loss, and lightly's MSELoss on the masked patches --------------------
    pred = p["mae.pred"].clone().requires_grad_()
    target, mask = p["mae.target"], p["mae.mask"]
    norm_pix = float(p["mae.norm_pix"]) == 1.0
    if norm_pix:  # facebookresearch/mae models_mae.py forward_loss
        mean, var = target.mean(dim=-1, keepdim=True), target.var(dim=-1, keepdim=True)
        target = (target - mean) / (var + 1.0e-6) ** 0.5
    per_patch = ((pred - target) ** 2).mean(dim=-1)
    loss = (per_patch * mask).sum() / mask.sum()
    loss.backward()
    cells = int(mask.sum().item()) * pred.shape[-1]
    # A mean of k non-negative squares: each order's error is within (k-1)u x their mean, the loss.
    mag = float(loss.detach())
    why = f"2(k-1)u x the loss ({mag:.3g}) for the mean of k = {cells} non-negative masked squares in another order"
    checks.append(scalar(f"MAE loss (the MAE authors' forward_loss, norm_pix {norm_pix})", p["mae.loss"], loss,
                         reorder_bound(cells, mag), why))
    checks.append(ref.tensor_check("MAE gradients", {"pred": p["mae.grad_pred"]}, {"pred": pred.grad}, 0.0))
    hidden = mask.bool()
    mse = torch.nn.MSELoss()(p["mae.pred"][hidden], target[hidden])
    checks.append(scalar("MAE loss (lightly's examples: MSELoss on the masked patches)", p["mae.loss"], mse,
                         reorder_bound(cells, mag), why))

    out = {"reference": f"lightly {version()} NTXentLoss, NegativeCosineSimilarity, DINOLoss; the MAE authors' "
                        "forward_loss", "technique": "ssl-losses", "checks": checks}
    out["verdict"] = "differs" if any(c["verdict"] == "differs" for c in checks) else "pass"
    return out
