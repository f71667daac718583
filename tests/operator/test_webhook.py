"""The validating webhook as the API server calls it: AdmissionReviews posted to the operator's webhook server."""

from __future__ import annotations

import asyncio
import copy

import aiohttp
import kopf
import pytest

from tests.support.agent_harness import free_port
from tests.support.operator_harness import cluster, simulated_gpu, start_operator, trainingjob


def _review(operation: str, new: dict, old: dict | None = None, user: str = "test") -> dict:
    kind = {"group": "tensile.dev", "version": "v1alpha1", "kind": "TrainingJob"}
    resource = {"group": "tensile.dev", "version": "v1alpha1", "resource": "trainingjobs"}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "u1", "kind": kind, "resource": resource, "requestKind": kind, "requestResource": resource,
        "name": new["metadata"]["name"], "namespace": "default", "operation": operation,
        "userInfo": {"username": user, "groups": ["system:authenticated"]}, "object": new, "oldObject": old, "dryRun": False, "options": None}}


async def _post(port: int, review: dict, handler: str = "tensile-validate") -> dict:
    """The webhook's answer to `review` at the path of Kopf's `handler`, once its server is up."""
    async with aiohttp.ClientSession() as http:
        for _ in range(100):
            try:
                async with http.post(f"http://127.0.0.1:{port}/{handler}", json=review) as r:
                    return (await r.json())["response"]
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.1)
    raise AssertionError("webhook server not up")


@pytest.mark.cluster
def test_updates_that_leave_the_spec_alone_are_allowed_even_when_the_job_no_longer_validates(tmp_path, forecaster):
    """The webhook validated every UPDATE against the cluster as it is now: once the job's node was gone, removing
    the finalizer was refused (the selector matched no GPU) and the job stayed Terminating. An UPDATE that keeps
    the spec and the tensile.dev/ annotations (finalizers, status, labels, other annotations) is always allowed;
    one that edits them is still checked."""
    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            await c.publish_node("node-b", [simulated_gpu("GPU-b0", 8, "Simulated A6000")])
            port = free_port()
            op = await start_operator(forecaster, webhook=kopf.WebhookServer(addr="127.0.0.1", port=port, insecure=True))
            try:
                old = trainingjob("x", "vgg16", 1, gpuSelector={"nodes": ["node-a"]})  # node-a is gone
                old["metadata"] |= {"namespace": "default", "finalizers": ["tensile.dev/release-gpu"],
                                    "annotations": {"tensile.dev/max-swap-rate": "0.5"}}
                new = copy.deepcopy(old)
                new["metadata"]["finalizers"] = []
                new["metadata"]["annotations"]["example.com/owner"] = "team-a"
                new["status"] = {"phase": "Failed"}
                assert (await _post(port, _review("UPDATE", new, old)))["allowed"] is True
                assert (await _post(port, _review("CREATE", new)))["allowed"] is False  # the same job, created now
                edited = copy.deepcopy(new)
                edited["spec"]["workload"]["batchSize"] = 0
                response = await _post(port, _review("UPDATE", edited, old))
                assert response["allowed"] is False and "spec.workload.batchSize" in response["status"]["message"]
                knob = copy.deepcopy(new)
                knob["metadata"]["annotations"]["tensile.dev/max-swap-rate"] = "2"
                response = await _post(port, _review("UPDATE", knob, old))
                assert response["allowed"] is False and "tensile.dev/max-swap-rate" in response["status"]["message"]
            finally:
                await op.stop()

    asyncio.run(scenario())


@pytest.mark.cluster
def test_only_who_may_create_pods_in_the_namespace_may_create_a_trainingjob_there(tmp_path, forecaster):
    """The operator creates a job's pod, with the service account its template names, on its own rights: a user who may
    create TrainingJobs but not pods in the namespace had it create pods for them. The webhook asks the API server
    (SubjectAccessReview); an UPDATE that leaves the job alone (a finalizer removed by anyone) is not asked about."""
    async def scenario() -> None:
        async with cluster(tmp_path) as c:
            await c.publish_node("node-a", [simulated_gpu("GPU-a0", 8, "Simulated A6000")])
            c.emu.pod_creators = {"default": {"alice"}}
            port = free_port()
            op = await start_operator(forecaster, webhook=kopf.WebhookServer(addr="127.0.0.1", port=port, insecure=True))
            try:
                job = trainingjob("x", "vgg16", 1, template={"spec": {"serviceAccountName": "admin", "containers": [
                    {"name": "train", "image": "example", "command": ["python", "-c", "pass"]}]}})
                job["metadata"]["namespace"] = "default"
                refused = await _post(port, _review("CREATE", job, user="mallory"))
                assert refused["allowed"] is False and refused["status"]["code"] == 403, refused
                assert "mallory may not create pods in namespace default" in refused["status"]["message"]
                assert (await _post(port, _review("CREATE", job, user="alice")))["allowed"] is True
                edited = copy.deepcopy(job)
                edited["spec"]["workload"]["batchSize"] = 2
                assert (await _post(port, _review("UPDATE", edited, job, user="mallory")))["allowed"] is False
                released = copy.deepcopy(job)
                released["metadata"]["finalizers"] = []
                assert (await _post(port, _review("UPDATE", released, job, user="mallory")))["allowed"] is True
            finally:
                await op.stop()

    asyncio.run(scenario())


AGENT = "system:serviceaccount:tensile-system:tensile-agent"


def _node_review(node: str, user: str, token_node: str | None, subresource: str | None = None) -> dict:
    kind = {"group": "tensile.dev", "version": "v1alpha1", "kind": "TensileNode"}
    resource = {"group": "tensile.dev", "version": "v1alpha1", "resource": "tensilenodes"}
    extra = {"authentication.kubernetes.io/node-name": [token_node]} if token_node else {}
    body = {"apiVersion": "tensile.dev/v1alpha1", "kind": "TensileNode", "metadata": {"name": node},
            "spec": {"nodeName": node}, "status": {"gpus": []}}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "u2", "kind": kind, "resource": resource, "requestKind": kind, "requestResource": resource,
        "subResource": subresource, "name": node, "operation": "UPDATE" if subresource else "CREATE",
        "userInfo": {"username": user, "extra": extra}, "object": body, "oldObject": body if subresource else None,
        "dryRun": False, "options": None}}


@pytest.mark.cluster
def test_an_agent_writes_only_its_own_nodes_tensilenode(tmp_path, forecaster, monkeypatch):
    """The agents' role may create TensileNodes and patch their status cluster-wide (RBAC cannot name an object not
    created yet), so a stolen agent credential could publish GPUs for another node, which the operator books. The
    webhook lets the agents' user write only the TensileNode of the node its token is bound to."""
    monkeypatch.setenv("TENSILE_AGENT_ACCOUNTS", AGENT)

    async def scenario() -> None:
        async with cluster(tmp_path):
            port = free_port()
            op = await start_operator(forecaster, webhook=kopf.WebhookServer(addr="127.0.0.1", port=port, insecure=True))
            try:
                async def review(node: str, user: str, token_node: str | None, subresource: str | None = None) -> dict:
                    return await _post(port, _node_review(node, user, token_node, subresource), "tensile-nodes")

                assert (await review("node-a", AGENT, "node-a"))["allowed"] is True
                assert (await review("node-a", AGENT, "node-a", "status"))["allowed"] is True
                for subresource in (None, "status"):
                    refused = await review("node-a", AGENT, "node-b", subresource)
                    assert refused["allowed"] is False and refused["status"]["code"] == 403, refused
                    assert "may write only the TensileNode of its own node (node-b), not node-a" in refused["status"]["message"]
                assert (await review("node-a", AGENT, None))["allowed"] is False  # a token bound to no node
                assert (await review("node-a", "kubernetes-admin", None))["allowed"] is True  # left to RBAC
            finally:
                await op.stop()

    asyncio.run(scenario())


def _status_review(old: dict, new: dict, user: str, token_node: str | None) -> dict:
    review = _review("UPDATE", new, old, user)
    extra = {"authentication.kubernetes.io/node-name": [token_node]} if token_node else {}
    review["request"] |= {"subResource": "status", "userInfo": {"username": user, "extra": extra}}
    return review


@pytest.mark.cluster
def test_an_agent_writes_only_the_observed_figures_of_its_own_nodes_jobs(tmp_path, forecaster, monkeypatch):
    """The agents' role may patch any TrainingJob's status (its `observed` figures), and the operator books capacity
    from the rest of the status: a stolen agent credential could move or resize any job's booking. The webhook lets the
    agents' user change only `status.observed`, of a job placed on the node its token is bound to; the bookings the
    operator rebuilds from the statuses are the same after such a write."""
    from tensile_operator.app import OperatorApp
    from tensile_operator.placement import Gpu

    monkeypatch.setenv("TENSILE_AGENT_ACCOUNTS", AGENT)
    gib = 1 << 30
    placed = trainingjob("x", None, profile="p", memoryBudget="2Gi")
    placed["metadata"] |= {"namespace": "default", "resourceVersion": "7"}
    placed["status"] = {"phase": "Running", "placement": {"gpu": "GPU-a0", "node": "node-a"},
                        "forecast": {"source": "budget", "reservedBytes": 2 * gib}}
    observed = copy.deepcopy(placed)
    observed["metadata"] |= {"resourceVersion": "8", "managedFields": [{"manager": "tensile-agent"}]}
    observed["status"]["observed"] = {"peakBytes": gib, "iterations": 3}
    moved = copy.deepcopy(observed)
    moved["status"]["placement"] = {"gpu": "GPU-b0", "node": "node-b"}
    grown = copy.deepcopy(observed)
    grown["status"]["forecast"]["reservedBytes"] = 1
    respec = copy.deepcopy(observed)
    respec["spec"]["memoryBudget"] = "1Gi"

    async def scenario() -> None:
        async with cluster(tmp_path):
            port = free_port()
            op = await start_operator(forecaster, webhook=kopf.WebhookServer(addr="127.0.0.1", port=port, insecure=True))
            try:
                async def review(new: dict, token_node: str | None, user: str = AGENT) -> dict:
                    return await _post(port, _status_review(placed, new, user, token_node), "tensile-job-writers")

                assert (await review(observed, "node-a"))["allowed"] is True
                for changed in (moved, grown, respec):
                    refused = await review(changed, "node-a")
                    assert refused["allowed"] is False and refused["status"]["code"] == 403, refused
                    message = refused["status"]["message"]
                    assert f"{AGENT} may write only status.observed of TrainingJob default/x" in message
                refused = await review(observed, "node-b")  # another node's agent
                assert refused["allowed"] is False and refused["status"]["code"] == 403, refused
                assert ("may write only the figures of a job placed on its own node (node-b), not of default/x "
                        "(placed on node-a)") in refused["status"]["message"]
                assert (await review(observed, None))["allowed"] is False  # a token bound to no node
                assert (await review(moved, None, "system:serviceaccount:tensile-system:tensile-operator"))["allowed"]
            finally:
                await op.stop()

    async def rebuilt(body: dict) -> dict:
        class Listing:
            async def list_trainingjobs(self) -> list[dict]:
                return [body]

            async def list_pods(self, selector: str) -> list[dict]:
                return []

        app = OperatorApp(forecaster, kube=Listing())
        app.capacity.inventory["node-a"] = [Gpu("node-a", "GPU-a0", "Simulated GPU", 4 * gib, 4 * gib, simulated=True)]
        await app.completion.rebuild_ledger()
        return app.capacity.ledger.bookings

    asyncio.run(scenario())
    assert asyncio.run(rebuilt(observed)) == asyncio.run(rebuilt(placed)) != {}
