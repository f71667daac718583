"""A small async Kubernetes client for the operator's own calls, on the credentials Kopf logged in with.

Every call names its (group, resource, verb) and is checked against `rbac.RULES` first, so the list
the chart's role is generated from cannot fall behind the code.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import aiohttp
import kopf

from tensile_operator import GROUP, VERSION
from tensile_operator.rbac import allowed

T = TypeVar("T")
DRA = "resource.k8s.io"  # Dynamic Resource Allocation's API group


class KubeError(Exception):
    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(f"HTTP {status}: {message}")


class NotFound(KubeError):
    pass


class Conflict(KubeError):
    pass


def transient(exc: Exception) -> bool:
    """The API server's trouble (a 5xx, 429 too many requests, no connection), not the request's: sent again
    later, the same request may succeed."""
    if isinstance(exc, KubeError):
        return exc.status >= 500 or exc.status == 429
    return isinstance(exc, (aiohttp.ClientError, TimeoutError))


async def retried(call: Callable[[], Awaitable[T]], delays: Sequence[float],
                  on_retry: Callable[[Exception, float], Awaitable[None]] | None = None) -> T:
    """`call()`, made again after each of `delays` (seconds) while it fails transiently: one 503 or a leader
    election must not leave a job without its pod or its end. `on_retry(error, delay)` before each wait; the
    last failure, and any that is not transient, is raised."""
    for delay in delays:
        try:
            return await call()
        except Exception as exc:  # noqa: BLE001 - re-raised unless transient
            if not transient(exc):
                raise
            if on_retry is not None:
                await on_retry(exc, delay)
        await asyncio.sleep(delay)
    return await call()


def _path(group: str, version: str, plural: str, namespace: str | None, name: str | None, sub: str | None) -> str:
    base = f"/api/{version}" if group == "" else f"/apis/{group}/{version}"
    if namespace:
        base += f"/namespaces/{namespace}"
    base += f"/{plural}"
    if name:
        base += f"/{name}"
    if sub:
        base += f"/{sub}"
    return base


class Kube:
    def __init__(self) -> None:
        self._info: kopf.ConnectionInfo | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ready = asyncio.Event()
        self._stale: list[aiohttp.ClientSession] = []
        self.calls: dict[tuple[str, str, str], int] = {}

    def login(self, info: kopf.ConnectionInfo) -> None:
        """Kopf logs in again at start-up with equal credentials: keep the session then (a new one costs
        its TLS context, ~40 ms on the event loop, in the middle of the first admissions)."""
        if self._info != info:
            self._info = info
            if self._session is not None:
                self._stale.append(self._session)
                self._session = None
        self._ready.set()

    async def _client(self) -> tuple[aiohttp.ClientSession, str]:
        await self._ready.wait()
        assert self._info is not None
        if self._session is None or self._session.closed:
            info = self._info
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                auth = info.as_aiohttp_basic_auth()
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ssl=info.as_ssl_context()),
                headers=info.as_http_headers(), auth=auth, trust_env=info.trust_env,
            )
        return self._session, self._info.server.rstrip("/")

    async def close(self) -> None:
        for stale in self._stale:
            await stale.close()
        self._stale.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def call(self, verb: str, group: str, version: str, plural: str, *, namespace: str | None = None,
                   name: str | None = None, sub: str | None = None, body: Any = None, params: dict | None = None) -> dict:
        resource = f"{plural}/{sub}" if sub else plural
        if not allowed(group, resource, verb):
            raise PermissionError(f"{verb} {group or 'core'}/{resource} is not in tensile_operator.rbac.RULES")
        self.calls[(group, resource, verb)] = self.calls.get((group, resource, verb), 0) + 1
        method = {"get": "GET", "list": "GET", "create": "POST", "patch": "PATCH", "delete": "DELETE"}[verb]
        headers = {"Content-Type": "application/merge-patch+json"} if verb == "patch" else {}
        session, server = await self._client()
        url = server + _path(group, version, plural, namespace, name, sub)
        async with session.request(method, url, json=body, params=params, headers=headers) as response:
            try:
                data = await response.json(content_type=None)
            except ValueError:
                data = {"message": await response.text()}
            if response.status == 404:
                raise NotFound(404, (data or {}).get("message", ""))
            if response.status == 409:
                raise Conflict(409, (data or {}).get("message", ""))
            if response.status >= 400:
                raise KubeError(response.status, (data or {}).get("message", ""))
            return data or {}

    # The calls the operator makes, by name.
    async def list_trainingjobs(self) -> list[dict]:
        return (await self.call("list", GROUP, VERSION, "trainingjobs")).get("items", [])

    async def list_priorityclasses(self) -> list[dict]:
        return (await self.call("list", "scheduling.k8s.io", "v1", "priorityclasses")).get("items", [])

    async def list_tensilenodes(self) -> list[dict]:
        return (await self.call("list", GROUP, VERSION, "tensilenodes")).get("items", [])

    async def patch_job_status(self, namespace: str, name: str, status: dict, resource_version: str | None = None) -> dict:
        body: dict = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        return await self.call("patch", GROUP, VERSION, "trainingjobs", namespace=namespace, name=name, sub="status", body=body)

    async def get_job(self, namespace: str, name: str) -> dict:
        return await self.call("get", GROUP, VERSION, "trainingjobs", namespace=namespace, name=name)

    async def may_create_pods(self, user: dict, namespace: str) -> bool:
        """Whether `user` (an admission request's userInfo) may create pods in `namespace` (a SubjectAccessReview)."""
        spec = {key: user[key] for key in ("uid", "groups", "extra") if user.get(key)}
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                  "spec": spec | {"user": user.get("username", ""),
                                  "resourceAttributes": {"namespace": namespace, "verb": "create", "resource": "pods"}}}
        answer = await self.call("create", "authorization.k8s.io", "v1", "subjectaccessreviews", body=review)
        return bool((answer.get("status") or {}).get("allowed"))

    async def create_pod(self, namespace: str, pod: dict) -> dict:
        return await self.call("create", "", "v1", "pods", namespace=namespace, body=pod)

    async def find_pod(self, namespace: str, name: str) -> dict | None:
        """The pod, or None when it is gone (a terminating pod is still found)."""
        try:
            return await self.call("get", "", "v1", "pods", namespace=namespace, name=name)
        except NotFound:
            return None

    async def list_pods(self, label_selector: str) -> list[dict]:
        return (await self.call("list", "", "v1", "pods", params={"labelSelector": label_selector})).get("items", [])

    async def create_event(self, namespace: str, event: dict) -> dict:
        return await self.call("create", "", "v1", "events", namespace=namespace, body=event)

    async def create_resourceclaim(self, namespace: str, claim: dict) -> dict:
        return await self.call("create", DRA, "v1", "resourceclaims", namespace=namespace, body=claim)

    async def find_resourceclaim(self, namespace: str, name: str) -> dict | None:
        try:
            return await self.call("get", DRA, "v1", "resourceclaims", namespace=namespace, name=name)
        except NotFound:
            return None

    async def delete_resourceclaim(self, namespace: str, name: str) -> None:
        """A claim already gone is no error."""
        try:
            await self.call("delete", DRA, "v1", "resourceclaims", namespace=namespace, name=name)
        except NotFound:
            pass

    async def list_resourceclaims(self) -> list[dict]:
        return (await self.call("list", DRA, "v1", "resourceclaims")).get("items", [])

    async def list_resourceslices(self) -> list[dict]:
        return (await self.call("list", DRA, "v1", "resourceslices")).get("items", [])

    async def find_deviceclass(self, name: str) -> dict | None:
        try:
            return await self.call("get", DRA, "v1", "deviceclasses", name=name)
        except NotFound:
            return None

    async def delete_pod(self, namespace: str, name: str, options: dict | None = None) -> None:
        """`options`: DeleteOptions fields (`gracePeriodSeconds`, `preconditions`: a pod changed since is answered
        409). A pod already gone is no error."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", **options} if options else None
        try:
            await self.call("delete", "", "v1", "pods", namespace=namespace, name=name, body=body)
        except NotFound:
            pass
