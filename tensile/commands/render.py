"""`tensile render JOB.yaml`: print, as multi-document YAML, the objects the operator creates for a TrainingJob once
it is admitted (its ResourceClaim and its pod), on a simulated GPU unless one is named: what to check before applying.

The claim requests the size the job would be admitted with onto that GPU alone (its scheduled peak as the caching
allocator reserves it, plus the per-process context); beside other jobs its peak may be planned lower. The owner
references carry the TrainingJob's uid once Kubernetes has given it one (empty here).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from tensile.devices import PRESETS, device_preset
from tensile.errors import TensileUserError

SIMULATED_NODE = "simulated-node"
SIMULATED_GPU = "GPU-00000000-0000-0000-0000-000000000000"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("render", help="print the objects the operator would create for a TrainingJob",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("job", metavar="JOB.yaml", help="a TrainingJob manifest")
    parser.add_argument("--gpu", metavar="UUID", help=f"the GPU it is admitted onto (default: a simulated one, "
                                                      f"{SIMULATED_GPU})")
    parser.add_argument("--node", metavar="NODE", help=f"that GPU's node (default {SIMULATED_NODE})")
    parser.add_argument("--gpu-preset", choices=sorted(PRESETS), default="h100",
                        help="the GPU's memory and per-process context (default h100)")
    parser.add_argument("--gpu-access", choices=("dra", "legacy"), default="dra",
                        help="as the chart's gpuAccess.mode: a ResourceClaim (dra, default), or node name and "
                             "environment variables (legacy)")
    parser.add_argument("--device-class", help="the DeviceClass the claim names (default gpu.nvidia.com)")
    parser.add_argument("--namespace", help="the job's namespace (default: its manifest's, else default)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tensile_operator.claims import DEFAULT_DEVICE_CLASS, GpuAccess
    from tensile_operator.forecasting import Forecaster
    from tensile_operator.placement import Gpu
    from tensile_operator.rendering import admitted_objects, job_forecast
    from tensile import trainingjob_spec as model

    try:
        body = yaml.safe_load(Path(args.job).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise TensileUserError(f"cannot read {args.job}: {exc}") from None
    if not isinstance(body, dict) or body.get("kind") != "TrainingJob":
        raise TensileUserError(f"{args.job} is not a TrainingJob manifest")
    meta = body.setdefault("metadata", {})
    meta["namespace"] = args.namespace or meta.get("namespace") or "default"
    meta.setdefault("uid", "")
    try:
        spec = model.parse_spec(body.get("spec") or {}, meta.get("annotations"))
    except model.SpecError as exc:
        raise TensileUserError(f"{args.job}: {exc}") from None
    preset = device_preset(args.gpu_preset)
    gpu = Gpu(node=args.node or SIMULATED_NODE, uuid=args.gpu or SIMULATED_GPU, name=preset.name,
              memory_bytes=preset.memory_bytes, capacity_bytes=preset.memory_bytes, context_bytes=preset.context_bytes,
              simulated=not args.gpu, bandwidth=preset.host_link_bandwidth,
              compute_capability_major=preset.compute_capability_major)
    forecaster = Forecaster()
    try:
        forecast = job_forecast(spec, forecaster)
    finally:
        forecaster.close()
    access = GpuAccess(args.gpu_access, args.device_class or DEFAULT_DEVICE_CLASS)
    yaml.safe_dump_all(admitted_objects(body, forecast, gpu, access), sys.stdout, sort_keys=False)
    return 0
