"""Fit a family MLP to measured latencies (the only place, with measuring, that needs torch)."""

from __future__ import annotations

import numpy as np

from tensile.latency.mlp import FEATURE_CLIP, MAX_LOG_CORRECTION, MIN_STD, FamilyEnsemble, FamilyMLP

ENSEMBLE_MEMBERS = 3
SMALL_FAMILY_MEMBERS = 9
SMALL_FAMILY_SAMPLES = 1000


def ensemble_size(samples: int) -> int:
    """Members for a family fitted on this many samples. A small family's fit moves more from seed to seed
    and costs a second or two a member, so it averages more: on one calibration's measurements, the median
    over five seeds of embedding's held-out error went 14.2 -> 12.5%, softmax's 6.5 -> 5.9, pool's 5.1 -> 4.3
    (benchmarks/latency_fit_variance.py). The big families (optimizer, elementwise, conv) keep three: their
    fits are most of calibration's training time, and their seeds agree within two points."""
    return SMALL_FAMILY_MEMBERS if samples < SMALL_FAMILY_SAMPLES else ENSEMBLE_MEMBERS


def fit_ensemble(x: np.ndarray, y: np.ndarray, members: int | None = None, steps: int = 1500,
                 seed: int = 0) -> FamilyEnsemble:
    """`members` MLPs (default: `ensemble_size`) from different seeds (initial weights and early-stopping split)."""
    count = ensemble_size(len(y)) if members is None else members
    return FamilyEnsemble([fit_mlp(x, y, steps=steps, seed=seed * 100 + k) for k in range(count)])


def fit_mlp(
    x: np.ndarray,
    y: np.ndarray,
    hidden: tuple[int, ...] = (64, 64, 32),
    steps: int = 1500,
    lr: float = 1e-2,
    weight_decay: float = 1e-3,
    seed: int = 0,
) -> FamilyMLP:
    """Full-batch AdamW on a Huber loss of the log correction (robust to a few noisy timings),
    keeping the weights that did best on held-back samples.

    Four linear layers, as the paper's predictor; a few thousand parameters per family.
    """
    import torch

    x = np.asarray(x, dtype=np.float64)
    y = np.clip(np.asarray(y, dtype=np.float64), -MAX_LOG_CORRECTION, MAX_LOG_CORRECTION)
    if x.ndim != 2 or x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise ValueError(f"need matching non-empty samples, got x {x.shape} and y {y.shape}")
    mean = x.mean(axis=0)
    std = x.std(axis=0)
    std = np.maximum(std, MIN_STD)
    generator = torch.Generator().manual_seed(seed)
    widths = (x.shape[1], *hidden, 1)
    modules: list[torch.nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(widths[:-1], widths[1:])):
        linear = torch.nn.Linear(n_in, n_out, dtype=torch.float32)
        with torch.no_grad():
            bound = 1.0 / np.sqrt(n_in)
            linear.weight.uniform_(-bound, bound, generator=generator)
            linear.bias.zero_()
        modules.append(linear)
        if i < len(widths) - 2:
            modules.append(torch.nn.SiLU())
    net = torch.nn.Sequential(*modules)
    xt = torch.tensor(np.clip((x - mean) / std, -FEATURE_CLIP, FEATURE_CLIP), dtype=torch.float32)
    yt = torch.tensor(y, dtype=torch.float32).unsqueeze(1)
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    loss_fn = torch.nn.HuberLoss(delta=0.2)
    # Early stopping on a random 15% of the samples: timings are noisy, and an MLP that fits the noise
    # extrapolates wildly to the zoo's shapes.
    order = torch.randperm(len(yt), generator=generator)
    n_val = len(yt) // 7 if len(yt) >= 40 else 0
    val, fit = order[:n_val], order[n_val:]
    best_loss, best_state = float("inf"), None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a few thousand weights: threads only add synchronisation
    try:
        with torch.enable_grad():
            for i in range(steps):
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(net(xt[fit]), yt[fit])
                loss.backward()
                optimizer.step()
                schedule.step()
                if n_val and (i % 25 == 24 or i == steps - 1):
                    with torch.no_grad():
                        val_loss = float(loss_fn(net(xt[val]), yt[val]))
                    if val_loss < best_loss:
                        best_loss, best_state = val_loss, {k: v.clone() for k, v in net.state_dict().items()}
    finally:
        torch.set_num_threads(threads)
    if best_state is not None:
        net.load_state_dict(best_state)
    layers = [(m.weight.detach().double().numpy().copy(), m.bias.detach().double().numpy().copy())
              for m in net if isinstance(m, torch.nn.Linear)]
    return FamilyMLP(mean, std, layers, samples=int(x.shape[0]))
