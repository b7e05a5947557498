"""lightly's SSL losses as the reference for trainscope's objectives, on the same tensors.

An SSL cell's parity dump carries `ssl_losses` (suites/ssl/methods.cpp loss_probe): fixed inputs for
each objective, the loss trainscope computed and its gradients. Here lightly 1.6.0 computes the same:
`NTXentLoss` (also as rank 0 and rank 1 of 2 on a gathered batch), `NegativeCosineSimilarity` in BYOL's
symmetrised form, `DINOLoss` with its centre update, and MAE's masked-patch MSE as the MAE authors'
`forward_loss` writes it (lightly has no MAE loss class: its examples use `MSELoss` on the masked
patches, checked too). Where the two sides sum in another order the tolerance is the rounding bound of
that reordering, derived below; where they agree to the bit the verdict says so. Then one whole SimCLR
step and one DINO step (step_checks, below) against the same step in PyTorch with lightly's loss.
"""
import math
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


def scalar(name, ours, theirs, tol, why):
    a, b = float(torch.as_tensor(ours).detach()), float(torch.as_tensor(theirs).detach())
    out = {"name": name, "trainscope": a, "pytorch": b, "difference": abs(a - b)}
    if a == b:
        out.update(verdict="exact", tolerance=0.0)
    else:
        out.update(verdict="within" if abs(a - b) <= tol else "differs", tolerance=tol, tolerance_from=why)
    return out


def row(cell, dump, dump_path, lib):
    import reference as ref
    lib_ = _load()
    p = {k: v for k, v in dict(dump["ssl_losses"]).items()}
    checks = []

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

    checks += step_checks(cell, p, lib_)
    out = {"reference": f"lightly {version()} NTXentLoss, NegativeCosineSimilarity, DINOLoss; the MAE authors' "
                        "forward_loss; one SimCLR and one DINO step with lightly's loss", "technique": "ssl-losses",
           "checks": checks}
    out["verdict"] = "differs" if any(c["verdict"] == "differs" for c in checks) else "pass"
    return out


# ---- One whole step: the encoder, the method's heads, the loss, SGD (and DINO's teacher and centre) ----
# The dump's "<method>_step.*" (suites/ssl/methods.cpp step_probe): a fresh encoder and heads, fixed
# views, one step of plain SGD. Here the same step twice in PyTorch on the same weights and views: with
# trainscope's loss written again in Python (the same ATen ops in the same order: bit for bit, which
# proves the encoder, heads and update), and with lightly's loss, which rounds differently. The second
# is bounded per parameter: backprop is linear in the loss's gradient g at the embeddings z, so the two
# steps' parameters differ by lr |J^T (g_lightly - g_ours)| <= lr |J|^T |g_lightly - g_ours| (J = dz/dtheta,
# computed row by row), plus what each backward rounds on its own: it sums at most K products per
# gradient element (K = views x height x width, the widest sum: a convolution's weight gradient), each
# sum within (K-1)u of the sum of its terms' magnitudes: to first order |J|^T |g| for the rounding
# carried from upstream, and T (the layer's own |dy|^T |x|) for the last sum; plus one rounding of the
# update, u |theta|.

def _heads_forward(method, prm, h, layers=None):
    """trainscope's heads (suites/ssl/methods.cpp Head, DinoHead) on parameters by name, op for op.
    `layers` collects (kind, weight name, bias name, input, output) per layer with parameters."""
    F = torch.nn.functional
    layers = [] if layers is None else layers

    def linear(x, name):
        y = F.linear(x, prm[name + ".weight"], prm[name + ".bias"])
        layers.append(("linear", name + ".weight", name + ".bias", x, y))
        return y

    if method == "simclr":  # Linear, BatchNorm on the batch's statistics, ReLU, Linear
        x = linear(h, "projector.fc0")
        xf = x.to(torch.float32)
        mean, var = xf.mean(0), xf.var(0, unbiased=False)
        xhat = (xf - mean) / torch.sqrt(var + 1e-5)
        x = (xhat * prm["projector.bn0_weight"] + prm["projector.bn0_bias"]).to(x.dtype)
        layers.append(("affine", "projector.bn0_weight", "projector.bn0_bias", xhat, x))
        return linear(torch.relu(x), "projector.fc1")
    x = h  # DINO: an MLP with GELU to 128, L2-normalised, against L2-normalised prototypes
    for i in range(3):
        x = linear(x, f"dino_head.mlp.fc{i}")
        if i < 2:
            x = F.gelu(x)
    x = F.normalize(x.to(torch.float32), dim=1)
    return x.mm(F.normalize(prm["dino_head.last_layer"].to(torch.float32), dim=1).t())


def _nt_xent(z1, z2, t):
    """suites/ssl/methods.cpp nt_xent on one process, op for op."""
    F = torch.nn.functional
    a1, a2 = F.normalize(z1.to(torch.float32), dim=1), F.normalize(z2.to(torch.float32), dim=1)
    n = a1.shape[0]
    logits = torch.cat([a1, a2]).mm(torch.cat([a1, a2]).t()) / t
    idx = torch.arange(n)
    logits = logits.scatter(1, torch.cat([idx, idx + n]).unsqueeze(1), -1e9)
    return F.cross_entropy(logits, torch.cat([idx + n, idx]))


def _dino_loss(student, teacher, center, student_temp, teacher_temp):
    """suites/ssl/methods.cpp dino_loss, op for op."""
    total, terms = None, 0
    for iq, t in enumerate(teacher):
        q = torch.softmax((t.to(torch.float32) - center) / teacher_temp, -1).detach()
        for v, s in enumerate(student):
            if v != iq:
                term = torch.sum(-q * torch.log_softmax(s.to(torch.float32) / student_temp, -1), -1).mean()
                total = term if total is None else total + term
                terms += 1
    return total / float(terms)


def bounded_check(name, ours, theirs, bounds, why):
    """Named tensors against per-element bounds: exact, within (every |difference| <= its own bound), or
    differs; `share_of_bound` is the largest |difference| / bound."""
    import reference as ref
    out = ref.tensor_check(name, ours, theirs, max(b.max().item() for b in bounds.values()), why)
    if out["verdict"] == "exact" or "note" in out:
        return out
    shares = {k: ((ours[k].to(torch.float64) - theirs[k].to(torch.float64)).abs() / bounds[k].clamp_min(1e-300)).max().item()
              for k in ours}
    worst = max(shares, key=shares.get)
    out.update(worst=worst, share_of_bound=shares[worst], verdict="within" if shares[worst] <= 1.0 else "differs")
    return out


def step_checks(cell, p, lib_):
    import copy

    import models
    import reference as ref
    preset = cell["model"].get("preset", "")
    if "simclr_step.views" not in p:
        return [{"name": "one SimCLR and one DINO step", "verdict": "skipped",
                 "reason": f"the dump has no step probe (it mirrors cnn encoders; this cell's is '{preset}')"}]
    checks = []
    for method in ("simclr", "dino"):
        key, label = method + "_step.", "SimCLR" if method == "simclr" else "DINO"
        views, lr = p[key + "views"], float(p[key + "lr"])
        before = {k[len(key + "before/"):]: v for k, v in p.items() if k.startswith(key + "before/")}
        after = {k[len(key + "after/"):]: v for k, v in p.items() if k.startswith(key + "after/")}
        encoder = models.make_model(preset, image_shape=tuple(views.shape[1:]))
        encoder.train()
        prm = {}
        with torch.no_grad():  # the encoder's own parameters are the leaves, loaded by name
            for n, q in encoder.named_parameters():
                if "encoder." + n in before:
                    q.copy_(before["encoder." + n])
                    prm["encoder." + n] = q
        prm.update({k: v.clone().requires_grad_() for k, v in before.items() if not k.startswith("encoder.")})
        if set(prm) != set(before):
            raise ref.InputError(f"the {label} step's parameters do not match the Python mirror of {preset}: "
                                 + ", ".join(sorted(set(prm) ^ set(before))[:4]))
        teacher_encoder = copy.deepcopy(encoder)  # DINO's teacher: the student before the step
        layers = []
        hooks = [m.register_forward_hook(lambda m, i, o, pre=pre: layers.append(
                     ("conv" if isinstance(m, torch.nn.Conv2d) else "bn2d", pre + ".weight", pre + ".bias", i[0], o)))
                 for pre, m in (("encoder." + n, m) for n, m in encoder.named_modules())
                 if isinstance(m, (torch.nn.Conv2d, torch.nn.BatchNorm2d))]
        z = _heads_forward(method, prm, encoder.features(views), layers).chunk(2)
        for hk in hooks:
            hk.remove()
        zl = [t.detach().clone().requires_grad_() for t in z]  # where the losses' gradients are taken
        n = zl[0].shape[0]
        if method == "simclr":
            t = float(p["simclr.temperature"])
            ours_loss = _nt_xent(zl[0], zl[1], t)
            theirs_loss = lib_.loss.NTXentLoss(temperature=t)(zl[0], zl[1])
            mag = 2 / t + math.log(2.0 * n)
            loss_bound, loss_why = reorder_bound(4 * n, mag), f"2(k-1)u x {mag:.3g} for k = {4 * n}: NT-Xent's sums in another order"
        else:
            st, tt, m = float(p["dino.student_temp"]), float(p["dino.teacher_temp"]), float(p["dino.center_momentum"])
            with torch.no_grad():
                t_all = _heads_forward(method, {k: v.detach() for k, v in prm.items()}, teacher_encoder.features(views))
            k_proto = t_all.shape[1]
            ours_loss = _dino_loss(zl, list(t_all.chunk(2)), torch.zeros(1, k_proto), st, tt)
            dino = lib_.loss.DINOLoss(output_dim=k_proto, warmup_teacher_temp=tt, teacher_temp=tt,
                                      warmup_teacher_temp_epochs=0, student_temp=st, center_momentum=m)
            theirs_loss = dino(teacher_out=list(t_all.chunk(2)), student_out=list(zl), teacher_temp=tt)
            mag = math.log(k_proto) + float(max(t.detach().abs().max() for t in zl)) / st
            loss_bound = reorder_bound(2 * k_proto * n, mag)
            loss_why = f"2(k-1)u x {mag:.3g} for k = {2 * k_proto * n} products summed in another order"
        g_ours = torch.cat([g.flatten() for g in torch.autograd.grad(ours_loss, zl)])
        g_theirs = torch.cat([g.flatten() for g in torch.autograd.grad(theirs_loss, zl)])
        names = list(prm)
        leaves = [prm[k] for k in names]
        zflat = torch.cat([t.flatten() for t in z])

        def step(g):
            grads = torch.autograd.grad(zflat, leaves, grad_outputs=g, retain_graph=True)
            return {k: prm[k].detach().clone().add_(gr, alpha=-lr) for k, gr in zip(names, grads)}

        ours_after, theirs_after = step(g_ours), step(g_theirs)
        delta, gabs = (g_theirs - g_ours).abs(), g_ours.abs().maximum(g_theirs.abs())
        jd = {k: torch.zeros(prm[k].shape, dtype=torch.float64) for k in names}  # |J|^T |delta|
        jg = {k: torch.zeros(prm[k].shape, dtype=torch.float64) for k in names}  # |J|^T |g|
        for j in range(zflat.numel()):
            if gabs[j] == 0:
                continue
            for k, r in zip(names, torch.autograd.grad(zflat[j], leaves, retain_graph=True, allow_unused=True)):
                if r is not None:
                    a = r.abs().to(torch.float64)
                    jd[k] += a * float(delta[j])
                    jg[k] += a * float(gabs[j])
        # The magnitude of the terms each parameter's gradient sums, from its layer's input and output
        # gradient in absolute value (|dy|^T |x| for a weight, sum |dy| for a bias): where the exact
        # gradient cancels (a bias before a batch-statistics BatchNorm: J = 0), both sides' gradients are
        # that sum's rounding, which |J| alone cannot see.
        terms = {k: torch.zeros(prm[k].shape, dtype=torch.float64) for k in names}
        for g in (g_ours, g_theirs):
            dys = torch.autograd.grad(zflat, [lay[4] for lay in layers], grad_outputs=g, retain_graph=True)
            for (kind, wname, bname, x, _), dy in zip(layers, dys):
                signed, x, dy = x.detach().to(torch.float64), x.detach().abs().to(torch.float64), dy.abs().to(torch.float64)
                if kind == "linear":
                    w, b = dy.t().mm(x), dy.sum(0)
                elif kind == "affine":
                    w, b = (dy * x).sum(0), dy.sum(0)
                elif kind == "conv":
                    conv = next(m for n, m in encoder.named_modules() if "encoder." + n + ".weight" == wname)
                    w = torch.nn.grad.conv2d_weight(x, conv.weight.shape, dy, conv.stride, conv.padding)
                    b = None
                else:  # BatchNorm2d: x-hat from the batch's statistics
                    mean, var = signed.mean((0, 2, 3), keepdim=True), signed.var((0, 2, 3), unbiased=False, keepdim=True)
                    w, b = (dy * ((signed - mean) / torch.sqrt(var + 1e-5)).abs()).sum((0, 2, 3)), dy.sum((0, 2, 3))
                for name, t in ((wname, w), (bname, b)):
                    if t is not None and name in terms:
                        terms[name] = terms[name].maximum(t.reshape(terms[name].shape))
        k_sum = views.shape[0] * views.shape[2] * views.shape[3]
        bounds = {k: lr * (jd[k] + 2 * (k_sum - 1) * U * (jg[k] + terms[k])) + U * theirs_after[k].abs().to(torch.float64)
                  for k in names}
        why = (f"lr (|J|^T |g_lightly - g_ours| + 2(K-1)u (|J|^T |g| + T)) + u |theta| per parameter, K = {k_sum}, T the "
               f"magnitude of the terms its gradient sums: the losses' gradient difference at the {zflat.numel()} "
               "embedding values carried through the Jacobian, and each backward's own rounding")
        checks.append(scalar(f"{label} step: the loss in PyTorch (trainscope's loss written again)", p[key + "loss"],
                             ours_loss, 0.0, ""))
        checks.append(ref.tensor_check(f"{label} step: parameters after one SGD step in PyTorch (trainscope's loss)",
                                       after, ours_after))
        reference_loss = "NTXentLoss" if method == "simclr" else "DINOLoss"
        checks.append(scalar(f"{label} step: lightly's {reference_loss} on the same embeddings", p[key + "loss"],
                             theirs_loss, loss_bound, loss_why))
        checks.append(bounded_check(f"{label} step: parameters after one SGD step with lightly's {reference_loss}",
                                    after, theirs_after, bounds, why))
        if method == "dino":
            tau = float(p[key + "tau"])
            teacher = {k[len(key + "teacher_after/"):]: v for k, v in p.items() if k.startswith(key + "teacher_after/")}
            # The EMA teacher, tau x teacher + (1 - tau) x student, the teacher being the student before the step.
            def ema(student):
                return {k: prm[k].detach().clone().mul_(tau).add_(student[k], alpha=1 - tau) for k in teacher}
            checks.append(ref.tensor_check("DINO step: the EMA teacher after the step (trainscope's loss)", teacher,
                                           ema(ours_after)))
            theirs_teacher = ema(theirs_after)
            checks.append(bounded_check("DINO step: the EMA teacher after the step (lightly's DINOLoss)", teacher,
                                        theirs_teacher,
                                        {k: (1 - tau) * bounds[k] + U * theirs_teacher[k].abs().to(torch.float64) for k in teacher},
                                        f"(1 - tau) x the student's bound + u |teacher|, tau = {tau:.6g}"))
            tmag = float(t_all.abs().max())
            checks.append(ref.tensor_check("DINO step: the centre after the step (lightly's DINOLoss)",
                                           {"center": p[key + "center_after"]}, {"center": dino.center.reshape(1, -1)},
                                           reorder_bound(t_all.shape[0], tmag),
                                           f"2(k-1)u x {tmag:.3g} for the k = {t_all.shape[0]} teacher outputs averaged"))
    return checks
