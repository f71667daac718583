"""Cluster state: the node's `TensileNode` (inventory + committed forecasts) and each `TrainingJob`'s
observed figures, written with the kubernetes client from a thread of its own (never the event loop).

On only in a cluster: `KUBERNETES_SERVICE_HOST` set and a node name given (`--node-name` or
`NODE_NAME` from the downward API). Otherwise it is off and nothing fails. Group `tensile.dev`,
version `v1alpha1` (crds/tensilenodes.tensile.dev.yaml, crds/trainingjobs.tensile.dev.yaml).

API calls it makes (the chart's ClusterRole for the agent):
  tensilenodes         get, create        (the node's own object, created when missing)
  tensilenodes/status  patch              (merge patch of .status)
  trainingjobs/status  patch              (merge patch of .status.observed; 404 ignored: a job the
                                           operator did not place, e.g. `tensile run --agent`; the webhook
                                           refuses any other field, and a job placed on another node)
  tokenreviews         create             (tensile_agent.auth: the credentials of the pods and the operator)
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from tensile.agent_contract import utc_timestamp
from tensile_agent.state import AgentState

log = logging.getLogger("tensile_agent.cluster")
GROUP, VERSION = "tensile.dev", "v1alpha1"
RBAC = [
    (GROUP, "tensilenodes", ("get", "create")),
    (GROUP, "tensilenodes/status", ("patch",)),
    (GROUP, "trainingjobs/status", ("patch",)),
    ("authentication.k8s.io", "tokenreviews", ("create",)),
]


def in_cluster(node: str | None) -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and bool(node)


def tensilenode_status(state: AgentState, agent_url: str | None) -> dict:
    """.status of the node's TensileNode (camelCase, as the CRD and the operator's reader expect)."""
    gpus = []
    for uuid in state.inventory.gpus:
        s = state.gpu_summary(uuid)
        entry: dict[str, Any] = {
            "uuid": uuid, "index": s["index"], "name": s["name"], "memoryBytes": s["memory_bytes"],
            "capacityBytes": s["capacity_bytes"], "contextBytesPerJob": s["context_bytes"],
            "hostLinkBandwidth": s["host_link_bandwidth"], "simulated": s["simulated"],
            "computeCapabilityMajor": s["compute_capability_major"],
            "committed": {"vanillaPeakBytes": s["committed"]["vanilla_peak_bytes"],
                          "scheduledPeakBytes": s["committed"]["scheduled_peak_bytes"]},
            "jobs": [{k: v for k, v in {
                "job": j["job"], "external": j["external"], "vanillaPeakBytes": j["vanilla_peak_bytes"],
                "scheduledPeakBytes": j["scheduled_peak_bytes"], "observedPeakBytes": j["observed_peak_bytes"],
                "observedPlannedPeakBytes": j["observed_planned_peak_bytes"],
                "observedReservedPeakBytes": j["observed_reserved_peak_bytes"],
                "forecastReservedPeakBytes": j["forecast_reserved_peak_bytes"],
                "memoryBudgetBytes": j["memory_budget_bytes"],
                "planVersion": j["plan_version"]}.items() if v is not None} for j in s["jobs"]],
        }
        if s["used_bytes"] is not None:
            entry["usedBytes"] = s["used_bytes"]
        if s["utilization"] is not None:
            entry["utilization"] = s["utilization"]
        gpus.append(entry)
    # agentEpoch: this process, so that the operator sees a restart (which forgot its admissions) and admits again
    status: dict[str, Any] = {"gpus": gpus, "agentEpoch": state.epoch, "updatedAt": utc_timestamp()}
    if agent_url:
        status["agentAddress"] = agent_url
    if state.inventory.reason:
        status["message"] = state.inventory.reason
    return status


def observed_status(job: Any) -> dict:
    o = job.observed
    fields = {"peakBytes": o.peak_bytes, "plannedPeakBytes": o.planned_peak_bytes,
              "reservedPeakBytes": o.reserved_peak_bytes, "iterations": o.iterations,
              "iterationSeconds": o.iteration_seconds, "stallSeconds": o.stall_seconds,
              "outOfMemoryRetries": o.out_of_memory_retries, "planVersion": o.plan_version,
              "signatureMatch": o.signature_match}
    return {k: v for k, v in fields.items() if v is not None} | {"updatedAt": utc_timestamp()}


class ClusterPublisher:
    """Writes the TensileNode on changes (debounced) and every `interval` seconds; TrainingJob observed
    figures when a job's hook reported since the last write. `api`: a kubernetes CustomObjectsApi
    (made from the in-cluster config when None)."""

    def __init__(self, state: AgentState, node: str, agent_url: str | None, api: Any = None,
                 interval: float = 15.0, debounce: float = 1.0) -> None:
        self.state = state
        self.node = node
        self.agent_url = agent_url
        self.api = api
        self.interval = interval
        self.debounce = debounce
        self.errors = 0
        self.writes = 0
        self._published: dict[str, float] = {}  # job -> observed.updated_at last written
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ensured = False

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="tensile-cluster", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self.state.changed.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _client(self) -> Any:
        if self.api is None:
            from kubernetes import client, config

            config.load_incluster_config()
            self.api = client.CustomObjectsApi()
        return self.api

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.publish()
            except Exception as exc:  # noqa: BLE001 - the API server may be away; try again later
                self.errors += 1
                log.warning("publishing to the cluster failed: %s", exc)
            self.state.changed.wait(self.interval)
            if self._stop.is_set():
                return
            time.sleep(self.debounce)  # let a burst of changes land in one write
            self.state.changed.clear()

    def publish(self) -> None:
        api = self._client()
        if not self._ensured:
            self._ensure_node(api)
            self._ensured = True
        try:
            api.patch_cluster_custom_object_status(GROUP, VERSION, "tensilenodes", self.node,
                                                   {"status": tensilenode_status(self.state, self.agent_url)})
        except Exception:
            self._ensured = False  # deleted meanwhile? create it again next time
            raise
        self.writes += 1
        with self.state.lock:
            jobs = [j for j in self.state.jobs.values()
                    if j.observed.updated_at is not None and self._published.get(j.key) != j.observed.updated_at]
            bodies = [(j, j.observed.updated_at or 0.0, {"status": {"observed": observed_status(j)}}) for j in jobs]  # set: filtered above
            alive = set(self.state.jobs)
        for job, stamp, body in bodies:
            try:
                api.patch_namespaced_custom_object_status(GROUP, VERSION, job.ref.namespace, "trainingjobs", job.ref.name, body)
            except Exception as exc:  # noqa: BLE001 - one job's refused patch is that job's: the others are still written
                if getattr(exc, "status", None) != 404:
                    self.errors += 1
                    log.warning("publishing the observed figures of %s failed (tried again later): %s", job.key, exc)
                    continue
            self._published[job.key] = stamp
        for key in set(self._published) - alive:
            del self._published[key]

    def _ensure_node(self, api: Any) -> None:
        try:
            api.get_cluster_custom_object(GROUP, VERSION, "tensilenodes", self.node)
        except Exception as exc:  # noqa: BLE001
            if getattr(exc, "status", None) != 404:
                raise
            api.create_cluster_custom_object(GROUP, VERSION, "tensilenodes", {
                "apiVersion": f"{GROUP}/{VERSION}", "kind": "TensileNode",
                "metadata": {"name": self.node}, "spec": {"nodeName": self.node}})
