"""The scheduler's part of Dynamic Resource Allocation, as the emulator plays it (resource.k8s.io/v1).

From the documented rules of DRA and consumable capacity (KEP-5075): a claim's request names a DeviceClass (which must
exist) and CEL selectors; a device is a candidate when the class's and the request's selectors all hold for it. A
device with `allowMultipleAllocations` may be allocated to many claims: each consumes of every capacity the amount its
request names (`capacity.requests`), rounded up by that capacity's request policy (a capacity the request does not name
consumes the policy's default, else all of it), and the consumed sums never exceed the capacities. Any other device is
allocated to one claim at a time. The result is written as the API server keeps it:
`status.allocation.devices.results[]` with driver, pool, device, the request's name, `consumedCapacity` and a `shareID`
on a shared device, and the node the device is on as `status.allocation.nodeSelector`.

CEL is understood as far as selectors are written here: `&&`-joined comparisons `device.driver == "x"` and
`device.attributes["domain"].name == "value"` (string, integer or boolean values).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from tensile.admission import RequestPolicy, parse_quantity, quantity

_DRIVER = re.compile(r'^device\.driver\s*==\s*"([^"]*)"$')
_ATTRIBUTE = re.compile(r'^device\.attributes\["([^"]+)"\]\.(\w+)\s*==\s*(.+)$')


class Unallocatable(Exception):
    """The claim cannot be allocated now; the message is the scheduler's, for the pod's PodScheduled condition."""


@dataclass(frozen=True)
class Device:
    """One device of a ResourceSlice, with what allocation needs of it."""

    driver: str
    pool: str
    name: str
    node: str
    shared: bool  # allowMultipleAllocations
    attributes: dict
    capacity: dict  # capacity name -> {value, requestPolicy}

    @property
    def key(self) -> tuple[str, str, str]:
        return self.driver, self.pool, self.name

    def attribute(self, domain: str, name: str) -> object:
        """A qualified attribute's value (`domain/name`, or `name` in the driver's own domain)."""
        entry = self.attributes.get(f"{domain}/{name}")
        if entry is None and domain == self.driver:
            entry = self.attributes.get(name)
        return None if entry is None else next(iter(entry.values()))


def devices_of(slices: list[dict]) -> list[Device]:
    """Every device the ResourceSlices publish, from each pool's newest generation only (as the scheduler's
    allocator uses them: a driver's older slices linger until it deletes them)."""
    newest: dict[tuple[str, str], int] = {}
    for s in slices:
        pool = (s["spec"]["driver"], s["spec"]["pool"]["name"])
        newest[pool] = max(newest.get(pool, 0), int(s["spec"]["pool"]["generation"]))
    return [Device(s["spec"]["driver"], s["spec"]["pool"]["name"], d["name"], s["spec"].get("nodeName", ""),
                   bool(d.get("allowMultipleAllocations")), d.get("attributes") or {}, d.get("capacity") or {})
            for s in slices if int(s["spec"]["pool"]["generation"]) == newest[(s["spec"]["driver"],
                                                                                s["spec"]["pool"]["name"])]
            for d in s["spec"].get("devices") or []]


def selected(expression: str, device: Device) -> bool:
    """Whether a CEL selector (the subset in the module's docstring) holds for `device`."""
    for term in (t.strip().strip("()").strip() for t in expression.split("&&")):
        if match := _DRIVER.match(term):
            if device.driver != match[1]:
                return False
        elif match := _ATTRIBUTE.match(term):
            if device.attribute(match[1], match[2]) != _literal(match[3].strip()):
                return False
        else:
            raise ValueError(f"CEL the emulator does not understand: {term}")
    return True


def _literal(text: str) -> object:
    if text.startswith('"') and text.endswith('"'):
        return text[1:-1]
    if text in ("true", "false"):
        return text == "true"
    return int(text)


def consumption(claims: list[dict]) -> dict[tuple[str, str, str], dict[str, int]]:
    """Per device (driver, pool, name): the capacity each allocated claim consumes, summed; a device allocated whole
    (no consumedCapacity) counts as taken."""
    used: dict[tuple[str, str, str], dict[str, int]] = {}
    for claim in claims:
        for result in ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or []:
            sums = used.setdefault((result["driver"], result["pool"], result["device"]), {})
            consumed = result.get("consumedCapacity")
            if consumed is None:
                sums[""] = 1
            for name, amount in (consumed or {}).items():
                sums[name] = sums.get(name, 0) + parse_quantity(amount)
    return used


class Allocator:
    """Allocates claims against the ResourceSlices, DeviceClasses and the claims already allocated."""

    def __init__(self, slices: list[dict], classes: list[dict], claims: list[dict]) -> None:
        self.devices = devices_of(slices)
        self.classes = {c["metadata"]["name"]: c for c in classes}
        self.used = consumption(claims)

    def allocate(self, claim: dict) -> dict:
        """The claim's `status.allocation` (its requests all satisfied on one node), or Unallocatable."""
        results: list[dict] = []
        node = None
        for request in claim["spec"]["devices"]["requests"]:
            exactly = request["exactly"]
            device, consumed = self._pick(exactly, node)
            node = device.node
            sums = self.used.setdefault(device.key, {})
            result = {"request": request["name"], "driver": device.driver, "pool": device.pool,
                      "device": device.name}
            if device.shared:
                for name, amount in consumed.items():
                    sums[name] = sums.get(name, 0) + amount
                result |= {"consumedCapacity": {n: quantity(a) for n, a in consumed.items()},
                           "shareID": str(uuid.uuid4())}
            else:
                sums[""] = 1
            results.append(result)
        return {"devices": {"results": results}, "nodeSelector": {"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}}

    def _pick(self, exactly: dict, node: str | None) -> tuple[Device, dict[str, int]]:
        name = exactly["deviceClassName"]
        device_class = self.classes.get(name)
        if device_class is None:
            raise Unallocatable(f'resourceclaim: DeviceClass "{name}" not found')
        selectors = [s["cel"]["expression"] for s in (device_class["spec"].get("selectors") or []) +
                     (exactly.get("selectors") or [])]
        requested = {n: parse_quantity(v) for n, v in ((exactly.get("capacity") or {}).get("requests") or {}).items()}
        matching = [d for d in self.devices if (node is None or d.node == node)
                    and all(selected(e, d) for e in selectors)]
        if not matching:
            raise Unallocatable(f"cannot allocate all claims: no device of class {name} matches the selectors")
        for device in matching:
            consumed = self._fits(device, requested)
            if consumed is not None:
                return device, consumed
        raise Unallocatable(f"cannot allocate all claims: {len(matching)} matching device(s) of class {name} "
                            "lack the requested capacity")

    def _fits(self, device: Device, requested: dict[str, int]) -> dict[str, int] | None:
        """What `requested` consumes of `device`, None when it does not fit there now."""
        used = self.used.get(device.key, {})
        if not device.shared:
            return None if used or set(requested) - set(device.capacity) else {}
        if "" in used or set(requested) - set(device.capacity):
            return None
        consumed: dict[str, int] = {}
        for name, entry in device.capacity.items():
            value = parse_quantity(entry["value"])
            amount = RequestPolicy.from_capacity(entry).consumed(requested.get(name), value)
            if amount is None or used.get(name, 0) + amount > value:
                return None
            consumed[name] = amount
        return consumed
