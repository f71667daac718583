"""A cluster on one machine for operator tests: the emulator, the real operator, and test kubelets."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import kmock
import kopf
import yaml

from tensile_operator.app import OperatorApp
from tensile_operator.forecasting import Forecaster
from tensile_operator.main import operator
from tests.support.kube_emulator import KubeEmulator

OPERATOR_ACCOUNT = "system:serviceaccount:tensile-system:tensile-operator"  # the node agents' default
TJ = "tensile.dev/v1alpha1/trainingjobs"
TN = "tensile.dev/v1alpha1/tensilenodes"
GIB = 1024**3


class Cluster:
    def __init__(self, emulator: KubeEmulator, url: str, tmp: Path):
        self.emu = emulator
        self.url = url
        self.tmp = tmp
        self.kubelet_log: list[tuple] = []

    async def request(self, method: str, path: str, body=None, status_ok=(200, 201)):  # type: ignore[no-untyped-def]
        async with self.emu.request(method, path, json=body, headers={"Content-Type": "application/merge-patch+json"}) as r:
            data = await r.json(content_type=None)
            assert r.status in status_ok, (r.status, data)
            return data

    async def apply(self, manifest: dict, namespace: str = "default") -> dict:
        manifest = dict(manifest, metadata=dict(manifest["metadata"], namespace=namespace))
        return await self.request("POST", f"/apis/tensile.dev/v1alpha1/namespaces/{namespace}/trainingjobs", manifest)

    async def delete(self, name: str, namespace: str = "default") -> None:
        await self.request("DELETE", f"/apis/tensile.dev/v1alpha1/namespaces/{namespace}/trainingjobs/{name}", status_ok=(200, 202, 404))

    async def annotate(self, name: str, annotations: dict, namespace: str = "default") -> None:
        await self.request("PATCH", f"/apis/tensile.dev/v1alpha1/namespaces/{namespace}/trainingjobs/{name}",
                           {"metadata": {"annotations": annotations}})

    async def publish_node(self, name: str, gpus: list[dict], agent: str | None = None) -> None:
        body = {"apiVersion": "tensile.dev/v1alpha1", "kind": "TensileNode", "metadata": {"name": name}}
        if self.emu.get(TN, None, name) is None:
            await self.request("POST", "/apis/tensile.dev/v1alpha1/tensilenodes", body)
        status = {"gpus": gpus, "agentAddress": agent, "updatedAt": "2026-01-01T00:00:00Z"}
        await self.request("PATCH", f"/apis/tensile.dev/v1alpha1/tensilenodes/{name}/status", {"status": status})

    async def create(self, plural_key: str, body: dict) -> dict:
        """Any object, by its resource key ("group/version/plural", "v1/plural" for the core group)."""
        group_version, plural = plural_key.rsplit("/", 1)
        prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        namespace = body["metadata"].get("namespace")
        path = f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"
        return await self.request("POST", path, body)

    async def priority_class(self, name: str, value: int, global_default: bool = False) -> None:
        """A PriorityClass (scheduling.k8s.io/v1), as `kubectl create priorityclass NAME --value=N` makes it."""
        await self.request("POST", "/apis/scheduling.k8s.io/v1/priorityclasses", {
            "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": name},
            "value": value, "globalDefault": global_default})

    def node(self, name: str) -> dict | None:
        return self.emu.get(TN, None, name)

    def custom_objects_api(self):  # type: ignore[no-untyped-def]
        """A kubernetes-client CustomObjectsApi on the emulator: what a node agent's in-cluster config gives it."""
        from kubernetes import client

        return client.CustomObjectsApi(client.ApiClient(client.Configuration(host=self.url)))

    def authentication_api(self):  # type: ignore[no-untyped-def]
        """A kubernetes-client AuthenticationV1Api on the emulator (TokenReviews), as a node agent's in-cluster config gives."""
        from kubernetes import client

        return client.AuthenticationV1Api(client.ApiClient(client.Configuration(host=self.url)))

    def agent_authenticator(self):  # type: ignore[no-untyped-def]
        """What a node agent in this cluster checks credentials with: TokenReviews, the operator's account as the chart's."""
        from tensile_agent.auth import TokenReviewer

        return TokenReviewer({OPERATOR_ACCOUNT}, api=self.authentication_api())

    def pod_token_file(self, pod: dict) -> str:
        """The projected token the kubelet would write for `pod` (audience tensile), in a file of its own."""
        meta = pod["metadata"]
        path = self.tmp / f"token-{meta['namespace']}-{meta['name']}"
        path.write_text(self.emu.issue_token(meta["namespace"], pod["spec"].get("serviceAccountName") or "default",
                                             pod=meta["name"]))
        return str(path)

    def job(self, name: str, namespace: str = "default") -> dict | None:
        return self.emu.get(TJ, namespace, name)

    def jobs(self) -> list[dict]:
        return self.emu.items(TJ)

    def pods(self) -> list[dict]:
        return self.emu.items("v1/pods")

    async def set_pod_status(self, pod: dict, status: dict) -> None:
        meta = pod["metadata"]
        for attempt in range(20):  # a kubelet retries its status updates
            async with self.emu.request("PATCH", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                                        json={"status": status}, headers={"Content-Type": "application/merge-patch+json"}) as r:
                self.kubelet_log.append((meta["name"], meta["uid"], status.get("phase"), r.status))
                if r.status == 200:
                    return
            await asyncio.sleep(0.1)

    async def wait(self, predicate: Callable[[], object], timeout: float = 30.0, what: str = "") -> object:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"timed out waiting for {what or predicate}")
            await asyncio.sleep(0.05)


def phase(job: dict | None) -> str | None:
    return ((job or {}).get("status") or {}).get("phase")


def pod_env(pod: dict) -> dict[str, str]:
    """The training container's environment, as the hook in it sees it."""
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0].get("env") or []}


def simulated_gpu(uuid: str, gib: float, name: str = "Simulated GPU") -> dict:
    memory = int(gib * GIB)
    return {"uuid": uuid, "name": name, "index": 0, "memoryBytes": memory, "capacityBytes": memory, "simulated": True}


@contextlib.asynccontextmanager
async def cluster(tmp: Path) -> AsyncIterator[Cluster]:
    async with KubeEmulator() as emu, kmock.Server(emu) as server:
        url = str(server.url).rstrip("/")
        kubeconfig = tmp / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "emu", "cluster": {"server": url}}],
            "users": [{"name": "op", "user": {"token": "test"}}],
            "contexts": [{"name": "test", "context": {"cluster": "emu", "user": "op"}}],
        }))
        # the operator's projected token for the node agents (the chart's TENSILE_OPERATOR_TOKEN_FILE)
        token = tmp / "operator-token"
        token.write_text(emu.issue_token("tensile-system", "tensile-operator"))
        saved = {name: os.environ.get(name) for name in ("KUBECONFIG", "TENSILE_OPERATOR_TOKEN_FILE")}
        os.environ["KUBECONFIG"] = str(kubeconfig)
        os.environ["TENSILE_OPERATOR_TOKEN_FILE"] = str(token)
        c = Cluster(emu, url, tmp)
        await c.request("POST", "/apis/kopf.dev/v1/clusterkopfpeerings",
                        {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "tensile"}})
        try:
            yield c
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


class RunningOperator:
    """The operator in a thread with an event loop of its own, as in a cluster where it is its own process.

    Kopf, when it stops, cancels every task created in its event loop after it started (it cannot tell
    its own tasks from others). Sharing the test's loop, that included the emulator's per-connection
    handler tasks: their kept-alive connections stayed open with no reader, and the next requests the
    test kubelet sent on them were never answered (the stall of the restart test)."""

    def __init__(self, app: OperatorApp, webhook: kopf.WebhookServer | None = None, metrics_port: int = 0):
        self.app = app
        self.metrics_port = metrics_port
        self.stop_flag = threading.Event()
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, args=(webhook,), name="tensile-operator", daemon=True)

    def _run(self, webhook: kopf.WebhookServer | None) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            await operator(self.app, webhook=webhook, stop_flag=self.stop_flag, metrics_port=self.metrics_port,
                           metrics_addr="127.0.0.1")

        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - reported by started()/stop()
            self.error = exc

    async def started(self, timeout: float = 30.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.app.capacity.ready.is_set():
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise AssertionError(f"the operator did not start: {self.error!r}")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        self.stop_flag.set()
        await asyncio.to_thread(self._thread.join, 20)
        if self._thread.is_alive() and self._loop is not None:
            self._loop.call_soon_threadsafe(lambda: [t.cancel() for t in asyncio.all_tasks()])
            await asyncio.to_thread(self._thread.join, 10)
        assert not self._thread.is_alive(), "the operator did not stop"


async def start_operator(forecaster: Forecaster, webhook=None, metrics_port: int = 0, **kwargs) -> RunningOperator:  # type: ignore[no-untyped-def]
    op = RunningOperator(OperatorApp(forecaster, token_key=b"test-key", **kwargs), webhook, metrics_port)
    await op.started()
    return op


async def serve_pods(c: Cluster, lifecycle: Callable[[dict], Awaitable[None]], reraise: bool = False,
                     bound_only: bool = False) -> None:
    """A kubelet's loop: one `lifecycle` task per new pod until cancelled (then the tasks are cancelled too);
    with `reraise`, a lifecycle that failed fails the kubelet; with `bound_only`, a pod waits until the scheduler has
    bound it to a node (a pod with claims: once they are allocated)."""
    started: set[str] = set()
    tasks: list[asyncio.Task] = []
    try:
        while True:
            if reraise:
                for t in [t for t in tasks if t.done() and not t.cancelled() and t.exception()]:
                    raise t.exception()  # type: ignore[misc]
            for pod in c.emu.new_items("v1/pods", started):
                if bound_only and not pod["spec"].get("nodeName"):
                    continue
                if pod["metadata"]["uid"] not in started:
                    started.add(pod["metadata"]["uid"])
                    tasks.append(asyncio.create_task(lifecycle(pod)))
            await asyncio.sleep(0.05)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def fake_kubelet(c: Cluster, run_seconds: Callable[[dict], float] = lambda pod: 0.3, fail: set[str] = frozenset(),
                       bound_only: bool = False) -> None:
    """Marks each new pod Running, then Succeeded (or Failed) after `run_seconds(pod)`."""

    async def lifecycle(pod: dict) -> None:
        await c.set_pod_status(pod, {"phase": "Running"})
        await asyncio.sleep(run_seconds(pod))
        if c.emu.get("v1/pods", pod["metadata"]["namespace"], pod["metadata"]["name"]) is None:
            return
        failed = pod["metadata"]["name"] in fail
        await c.set_pod_status(pod, {"phase": "Failed" if failed else "Succeeded", "containerStatuses": [
            {"name": "train", "state": {"terminated": {"exitCode": 1 if failed else 0, "reason": "Error" if failed else "Completed"}}}]})

    await serve_pods(c, lifecycle, reraise=True, bound_only=bound_only)


async def process_kubelet(c: Cluster, workdir: Path, root: Path, logs: dict[str, str]) -> None:
    """Runs each new pod for real: init containers, then the first container, as local processes.

    Volume mounts become folders under `workdir`; mount paths in env values and commands are
    rewritten to them. The main container runs in `root` (the image's working directory)."""

    async def run(cmd: list[str], env: dict[str, str], cwd: Path = root) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(*cmd, env=env, cwd=cwd, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
        out, _ = await proc.communicate()
        return proc.returncode or 0, out.decode(errors="replace")

    async def lifecycle(pod: dict) -> None:
        name = pod["metadata"]["name"]
        volumes = {v["name"]: workdir / name / v["name"] for v in pod["spec"].get("volumes") or []}

        def translate(container: dict) -> tuple[list[str], dict[str, str]]:
            mounts = {m["mountPath"]: str(volumes[m["name"]]) for m in container.get("volumeMounts") or []}

            paths = re.compile("|".join(re.escape(path) for path in sorted(mounts, key=len, reverse=True)))

            def sub(text: str) -> str:  # in one pass: a folder put in place of one mount path is not read as another
                return paths.sub(lambda match: mounts[match.group(0)], text) if mounts else text

            cmd = [sub(a) for a in (container.get("command") or []) + (container.get("args") or [])]
            cmd = [sys.executable if a == "python" else a for a in cmd]
            env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
            env |= {e["name"]: sub(e.get("value", "")) for e in container.get("env") or []}
            return cmd, env

        for path in volumes.values():
            path.mkdir(parents=True, exist_ok=True)
        for volume in pod["spec"].get("volumes") or []:  # projected service-account tokens, as the kubelet writes them
            for source in (volume.get("projected") or {}).get("sources") or []:
                if "serviceAccountToken" in source:
                    token = source["serviceAccountToken"]
                    (volumes[volume["name"]] / token["path"]).write_text(c.emu.issue_token(
                        pod["metadata"]["namespace"], pod["spec"].get("serviceAccountName") or "default", pod=name,
                        audience=token["audience"], seconds=token.get("expirationSeconds", 3600)))
        output = []
        for init in pod["spec"].get("initContainers") or []:
            cmd, env = translate(init)
            # the Tensile image has tensile installed, and no source tree in its working directory
            # (a top-level `operator` folder there would shadow the standard library's)
            image_path = [p for p in sys.path[1:] if p and Path(p).resolve() != root.resolve()]
            env["PYTHONPATH"] = os.pathsep.join(image_path)
            code, out = await run(cmd, env, cwd=workdir)
            output.append(out)
            if code:
                logs[name] = "".join(output)
                await c.set_pod_status(pod, {"phase": "Failed", "message": f"init container failed: {out[-500:]}"})
                return
        await c.set_pod_status(pod, {"phase": "Running"})
        container = pod["spec"]["containers"][0]
        cmd, env = translate(container)
        code, out = await run(cmd, env)
        output.append(out)
        logs[name] = "".join(output)
        await c.set_pod_status(pod, {"phase": "Succeeded" if code == 0 else "Failed", "containerStatuses": [
            {"name": container["name"], "state": {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}}}]})

    await serve_pods(c, lifecycle)


def trainingjob(name: str, model: str | None = "vgg16", batch: int = 1, command: list[str] | None = None, **spec) -> dict:  # type: ignore[no-untyped-def]
    workload = {"model": model, "batchSize": batch} if model else {"profile": spec.pop("profile", "custom")}
    body = {"workload": workload, "template": {"spec": {"containers": [
        {"name": "train", "image": "example", "command": command or ["python", "-c", "pass"]}]}}}
    body.update(spec)
    return {"apiVersion": "tensile.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name}, "spec": body}


def jitter(low: float, high: float) -> Callable[[dict], float]:
    rng = random.Random(0)
    return lambda pod: rng.uniform(low, high)


@contextlib.asynccontextmanager
async def gpu_held_by_big(tmp_path: Path, forecaster: Forecaster,
                          prepare: Callable[[Cluster], Awaitable[None]] | None = None) -> AsyncIterator[tuple[Cluster, OperatorApp]]:
    """One 4 GiB GPU, the operator running (its OperatorApp), and job "big" admitted with 3 GiB of it; `prepare` runs on
    the cluster before the operator starts (e.g. objects it lists at start-up)."""
    async with cluster(tmp_path) as c:
        await c.publish_node("node-a", [simulated_gpu("GPU-a0", 4)])
        if prepare is not None:
            await prepare(c)
        op = await start_operator(forecaster)
        try:
            await c.apply(trainingjob("big", None, profile="p", memoryBudget="3Gi"))
            await c.wait(lambda: phase(c.job("big")) == "Admitted", 20, "big admitted")
            yield c, op.app
        finally:
            await op.stop()
