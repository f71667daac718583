"""How much of a family's held-out error is the fit's own variance, not the machine's.

Two calibrations of the same code on the same quiet host (runs L27 and L28) scored softmax at 5.4% and 29.5%
median error with a label spread under 5%: either the measurements differ from run to run, or the MLPs
fitted to them do. This script separates the two. It measures calibration's default grid once, with the
held-out grid's passes timed alongside (as benchmarks/latency_accuracy.py does), keeps the measurements in
--cache, and then fits the family ensembles from the same measurements with --seeds different seeds for each
ensemble size in --members, scoring every fit on the same held-out truth. The spread of a family's median error
over the seeds is the fit's variance; what is left between two calibrations is the measurements'.

Run: .venv/bin/python benchmarks/latency_fit_variance.py --cache /tmp/fitvar.pkl [--seeds 5] [--members auto,3]
(measuring takes about 10 minutes of a quiet machine; with an existing --cache only the fits run). `--quick` measures
the quick grids instead (latency_accuracy.py --quick): with `--seeds 1 --members 1`, a smoke run's setting.
"""

from __future__ import annotations

import argparse
import json
import pickle
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from latency_accuracy import (RESULTS, HeldOutAlongside, _agreeing, family_accuracy, grids, label_spread,
                              median_of_passes, training_keys)
from tensile.latency.calibrate import fit_model, local_device, measure_probes
from tensile.latency.device import resolve_target
from tensile.latency.families import FAMILIES
from tensile.latency.measure import measure_roofline
from tensile.latency.probes import make_grid

TARGET = 15.0  # median APE per family, percent (docs/latency_model.md)


def measure(device_type: str, passes: int, budget_s: float, quick: bool) -> dict:
    """Calibration's measurements and the held-out passes timed between them, with the calibration grid's name."""
    calibration_grid, held_out_name = grids(quick)
    grid = make_grid(calibration_grid, seed=0, device_type=device_type)
    held_out = make_grid(held_out_name, seed=1, device_type=device_type)
    alongside = HeldOutAlongside(held_out, passes, device_type, len(grid))
    with Progress() as bar:
        task = bar.add_task(f"measuring {len(grid)} calibration probes (held-out passes alongside)", total=len(grid))

        def after_probe(probe: object) -> None:
            alongside(probe)
            bar.update(task, advance=1)

        roofline = measure_roofline(device_type, quick=quick)
        measured = measure_probes(grid, device_type, budget_s=budget_s, on_probe=after_probe)
    return {"roofline": roofline, "measured": measured, "held_out_passes": alongside.finish(), "grid": calibration_grid}


def fit_scores(data: dict, device: str, seeds: int, members: list[str], console: Console) -> dict[str, list[dict]]:
    """Per ensemble size (`auto`: train.ensemble_size, as calibration fits), per seed: each family's held-out
    median and p90 error."""
    device_type, key, name = local_device(device)
    groups = _agreeing(data["held_out_passes"])
    held_out = median_of_passes(groups)
    seen = training_keys(device_type, data.get("grid", "default"))  # caches made before the grid was kept: default
    prior = resolve_target(device).prior
    scores: dict[str, list[dict]] = {}
    for size in members:
        scores[size] = []
        for seed in range(seeds):
            began = time.perf_counter()
            model = fit_model(data["measured"], data["roofline"], key, name, device_type, {}, seed=seed,
                              members=None if size == "auto" else int(size))
            families = family_accuracy(model, prior, held_out, seen)
            scores[size].append({family: {"median_ape": r["median_ape"], "p90_ape": r["p90_ape"], "ops": r["ops"]}
                                 for family, r in families.items()})
            console.print(f"{size} members, seed {seed}: fitted in {time.perf_counter() - began:.0f} s; "
                          + ", ".join(f"{f} {r['median_ape']:.1f}" for f, r in families.items()))
    return scores


def summary(scores: dict[str, list[dict]]) -> dict:
    """Per ensemble size and family: min, median and max of the median error over seeds, and how many seeds met
    the target."""
    out: dict = {}
    for size, fits in scores.items():
        out[size] = {}
        for family in (*FAMILIES, "view"):
            values = [fit[family]["median_ape"] for fit in fits if family in fit]
            if values:
                out[size][family] = {"min": min(values), "median": float(np.median(values)), "max": max(values),
                                     "seeds_within_target": sum(v <= TARGET for v in values), "seeds": len(values)}
        out[size]["fits_with_every_family_within_target"] = sum(
            all(r["median_ape"] <= TARGET for r in fit.values()) for fit in fits)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache", type=Path, required=True, help="measurements (pickle): read if present, else written")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--members", default="auto,3",
                        help="comma-separated ensemble sizes (auto: as calibration chooses, train.ensemble_size)")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--calibration-budget", type=float, default=480.0, metavar="SECONDS")
    parser.add_argument("--quick", action="store_true",
                        help="measure the quick grids, not the default and held-out ones "
                             "(a smoke run: figures mean nothing)")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/latency_fit_variance_<device>.json")
    args = parser.parse_args()
    console = Console()
    warnings.simplefilter("ignore", UserWarning)
    torch.set_num_threads(args.threads)
    device_type, _, name = local_device(args.device)
    if args.cache.exists():
        data = pickle.loads(args.cache.read_bytes())
    else:
        data = measure(device_type, args.passes, args.calibration_budget, args.quick)
        args.cache.write_bytes(pickle.dumps(data))
    members = [m for m in args.members.split(",") if m]
    scores = fit_scores(data, args.device, args.seeds, members, console)
    result = {"device": name, "threads": args.threads, "torch": torch.__version__, "seeds": args.seeds,
              "probes": len(data["measured"]), "label_spread_percent": label_spread(_agreeing(data["held_out_passes"])),
              "target_median_ape_percent": TARGET, "summary": summary(scores), "fits": scores}
    table = Table(title=f"Held-out median error over {args.seeds} seeds, same measurements ({name})")
    table.add_column("family")
    for size in members:
        table.add_column(f"{size} members: min / median / max", justify="right")
    for family in (*FAMILIES, "view"):
        cells = [result["summary"][size].get(family) for size in members]
        if any(cells):
            table.add_row(family, *(f"{c['min']:.1f} / {c['median']:.1f} / {c['max']:.1f}" if c else "" for c in cells))
    table.add_row("fits with all within 15%", *(f"{result['summary'][s]['fits_with_every_family_within_target']} of "
                                                f"{args.seeds}" for s in members))
    console.print(table)
    out = args.out or RESULTS / f"latency_fit_variance_{device_type}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
