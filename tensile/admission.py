"""The GPU memory a job is admitted with, and so asks Kubernetes for (a ResourceClaim's `capacity.requests.memory`).

One number, from one function (`admitted_bytes`): the job's scheduled peak as the CUDA caching allocator would reserve
it (the peak its tensors hold plus what the allocator keeps beyond them, `allocator_slack`, cuBLAS's workspaces
included), plus the per-process CUDA context and what the libraries hold outside the allocator, rounded up to what
the device's request policy accepts (`RequestPolicy`). Admission books it, the claim requests it, and `tensile render`
prints it.

The request policy follows Kubernetes' consumable capacity (KEP-5075, resource.k8s.io/v1 `DeviceCapacity`): a
request without an amount consumes the policy's default (without one, the whole capacity); `validValues` rounds up to
the smallest listed value at least as large; `validRange` rounds up to `min`, then to `min + n * step`; an amount above
`max` (or above every valid value) cannot be had from that device at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tensile.allocator import reserved_peak
from tensile.cublas_workspaces import cublas_workspaces
from tensile.knobs import parse_memory
from tensile.peak import analyze_vanilla
from tensile.workload import Workload

GIB = 1024**3
MIB = 1024**2


def parse_quantity(value: object) -> int:
    """Bytes of a Kubernetes quantity ('80Gi', '81920Mi', '85899345920'), as a ResourceSlice or claim writes it."""
    return parse_memory(value, "quantity")


def quantity(nbytes: int) -> str:
    """`nbytes` as the canonical Kubernetes quantity the API server writes back: Gi or Mi where whole, else bytes."""
    for unit, size in (("Gi", GIB), ("Mi", MIB), ("Ki", 1024)):
        if nbytes and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return str(nbytes)


@dataclass(frozen=True)
class RequestPolicy:
    """A device capacity's `requestPolicy` (all amounts in bytes); the empty policy takes any amount as it is."""

    default: int | None = None
    minimum: int | None = None  # validRange.min
    maximum: int | None = None  # validRange.max
    step: int | None = None  # validRange.step
    valid_values: tuple[int, ...] = ()

    @classmethod
    def from_capacity(cls, capacity: Mapping) -> RequestPolicy:
        """The policy of a ResourceSlice device's capacity entry (`{value, requestPolicy}`)."""
        policy = capacity.get("requestPolicy") or {}
        valid_range = policy.get("validRange") or {}

        def amount(value: object) -> int | None:
            return None if value is None else parse_quantity(value)

        return cls(amount(policy.get("default")), amount(valid_range.get("min")), amount(valid_range.get("max")),
                   amount(valid_range.get("step")), tuple(parse_quantity(v) for v in policy.get("validValues") or ()))

    def to_capacity(self, value: int) -> dict:
        """The capacity entry a ResourceSlice device publishes with this policy."""
        policy: dict = {}
        if self.default is not None:
            policy["default"] = quantity(self.default)
        if self.valid_values:
            policy["validValues"] = [quantity(v) for v in self.valid_values]
        elif self.minimum is not None:
            policy["validRange"] = {"min": quantity(self.minimum)} | (
                {"max": quantity(self.maximum)} if self.maximum is not None else {}) | (
                {"step": quantity(self.step)} if self.step is not None else {})
        return {"value": quantity(value)} | ({"requestPolicy": policy} if policy else {})

    def consumed(self, requested: int | None, capacity: int) -> int | None:
        """What a request of `requested` bytes (None: the request names no amount) consumes of a device with
        `capacity`; None when the policy allows no such amount (the device cannot be allocated to it)."""
        if requested is None:
            return self.default if self.default is not None else capacity
        if self.valid_values:
            return next((v for v in self.valid_values if v >= requested), None)
        amount = requested
        if self.minimum is not None:
            amount = max(amount, self.minimum)
            if self.step:
                amount = self.minimum + -(-(amount - self.minimum) // self.step) * self.step
            if self.maximum is not None and amount > self.maximum:
                return None
        return amount


def allocator_slack(workload: Workload, workspace_bytes: int) -> int:
    """What the caching allocator reserves beyond the tensors' peak, for the vanilla run with expandable segments (the
    pod's default allocator setting) and cuBLAS's workspaces of `workspace_bytes` each (tensile.cublas_workspaces;
    the GPU's `booked_workspace_bytes`): its segments' rounding and fragmentation, and the workspaces, which the
    process holds beside its tensors from its first matmuls on and which no other booked figure counts. Added to a
    scheduled peak, it is that peak as the allocator would reserve it. Measured from the tensors' own peak
    (Algorithm 1's vanilla peak), not from the replay's requested peak, which holds the workspaces too. Zero on the
    CPU device, whose allocator caches nothing and which has no cuBLAS."""
    if workload.device != "cuda":
        return 0
    peaks = reserved_peak(workload, expandable_segments=True, workspaces=cublas_workspaces(workload, workspace_bytes))
    return max(0, peaks.reserved_peak_bytes - analyze_vanilla(workload).peak_bytes)


def admitted_bytes(scheduled_peak: int, slack: int, context: int, policy: RequestPolicy | None = None,
                   capacity: int | None = None) -> int | None:
    """The memory a job is admitted with on a device: its scheduled peak + the allocator's `slack` + the per-process
    `context`, rounded up to the device's request `policy`; None when the policy (or the device's `capacity`) allows
    no amount that large."""
    need = scheduled_peak + slack + context
    amount = (policy or RequestPolicy()).consumed(need, capacity if capacity is not None else need)
    if amount is None or (capacity is not None and amount > capacity):
        return None
    return amount


def forecast_admitted_bytes(forecast_summary: dict, context_bytes: int) -> int:
    """`admitted_bytes` from a forecast (`tensile forecast --json`'s summary) on a device with no request policy (local
    mode): what the caching allocator reserves at the scheduled peak (`scheduled_reserved_peak_bytes`: the allocator's
    slack over the tensors, fragmentation included, which a neighbour pays for where only the tensors' bytes were
    counted) plus the per-job `context_bytes`. Where the summary carries a memory budget below the scheduled peak, the
    guard holds the tensors to it, and the slack comes on top. Never below the tensors' own bytes: an older forecast,
    without the reserved figure, counts those alone."""
    scheduled = int(forecast_summary["scheduled_peak_bytes"])
    reserved = max(scheduled, int(forecast_summary.get("scheduled_reserved_peak_bytes") or scheduled))
    budget = forecast_summary.get("memory_budget_bytes")
    held = scheduled if budget is None else min(scheduled, int(budget))
    admitted = admitted_bytes(held, reserved - scheduled, context_bytes)
    assert admitted is not None  # no policy and no capacity: every amount is allowed
    return admitted
