"""kmock 0.8's Kubernetes emulator, with the gaps that matter to a real Kopf operator closed (docs/operator.md, Tests).

kmock 0.8 keeps objects as plain merged dicts. This subclass adds what the API server does and the
operator relies on: metadata stamping (uid, resourceVersion, generation, creationTimestamp), optimistic
concurrency (409 on a stale resourceVersion, 422 on a failed JSON-patch test), the status subresource
(a patch of the object ignores .status, a patch of /status changes only .status), label selectors on
list and watch, and watches that subscribe before replaying the current objects (no lost events). It
also declares the resources Kopf needs before it starts, and answers TokenReviews of the service-account tokens a
test issued (`issue_token`: bound to a pod or not, of an audience, expiring), as the API server's authenticator would,
and SubjectAccessReviews of creating pods (`pod_creators`: who may, per namespace). Deletions take DeleteOptions: `preconditions`
(409 when the uid or resourceVersion no longer match) and, for a pod bound to a node whose kubelet is
gone (`unreachable`), `gracePeriodSeconds`: deleted with one, it is only marked terminating (no kubelet
confirms it); with 0 it is removed at once. Any other pod is removed at once, as if its kubelet
confirmed straight away.

It also plays the scheduler's part of Dynamic Resource Allocation (resource.k8s.io/v1; the rules are in
`tests.support.dra_allocator`): a pod created with `spec.resourceClaims` has its claims allocated at once and is bound
to their devices' node (`spec.nodeName`, each claim's `status.reservedFor`), or, when they cannot be, stays unbound
with PodScheduled False (Unschedulable) and the scheduler's message; such pods are tried again whenever a claim is
freed. A claim is deallocated, as the resource claim controller does, once no pod it is reserved for is left
unfinished. `device_overcommits` lists any device whose consumed capacity exceeds what it has.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import time
import uuid
from typing import Any

import aiohttp
import attrs
import jsonpatch
import yaml
from tests.support.dra_allocator import Allocator, Unallocatable, consumption, devices_of
from tensile.admission import parse_quantity
from kmock import KubernetesEmulator, KubernetesError, ResourceInfo, action, resource

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
RESOURCE_SLICES = "resource.k8s.io/v1/resourceslices"
DEVICE_CLASSES = "resource.k8s.io/v1/deviceclasses"
RESOURCE_CLAIMS = "resource.k8s.io/v1/resourceclaims"
PODS = "v1/pods"


@attrs.define(kw_only=True)
class KubeEmulator(KubernetesEmulator):
    _rv: int = attrs.field(default=0, init=False)
    _write_lock: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)
    _with_status: set = attrs.field(factory=set, init=False)
    _refused: dict = attrs.field(factory=dict, init=False)  # (resource, action) -> the status it is answered with
    refusals: list = attrs.field(factory=list, init=False)  # the bodies of the requests refused so far
    unreachable: set = attrs.field(factory=set, init=False)  # nodes whose kubelet is gone (never confirms a deletion)
    tokens: dict = attrs.field(factory=dict, init=False)  # token -> (username, audiences, pod or None, expiry)
    token_reviews: int = attrs.field(default=0, init=False)  # TokenReviews answered
    # SubjectAccessReviews of pod creation: namespace -> the users who may create pods there (not named: anyone may)
    pod_creators: dict = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.declare("v1/namespaces", "Namespace", namespaced=False)
        self.declare("v1/pods", "Pod", namespaced=True, subresources=("status",))
        self.declare("v1/events", "Event", namespaced=True)
        self.declare("scheduling.k8s.io/v1/priorityclasses", "PriorityClass", namespaced=False)
        self.declare("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", namespaced=False)
        self.declare("kopf.dev/v1/clusterkopfpeerings", "ClusterKopfPeering", namespaced=False)
        self.declare("kopf.dev/v1/kopfpeerings", "KopfPeering", namespaced=True)
        self.declare(RESOURCE_SLICES, "ResourceSlice", namespaced=False)
        self.declare(DEVICE_CLASSES, "DeviceClass", namespaced=False)
        self.declare(RESOURCE_CLAIMS, "ResourceClaim", namespaced=True, subresources=("status",))
        self.declare("authentication.k8s.io/v1/tokenreviews", "TokenReview", namespaced=False)
        self.declare("authorization.k8s.io/v1/subjectaccessreviews", "SubjectAccessReview", namespaced=False)
        for path in sorted((ROOT / "crds").glob("*.yaml")):
            self.declare_crd(yaml.safe_load(path.read_text()))

    # ---- declarations ---------------------------------------------------------------------------
    def declare(self, key: str, kind: str, namespaced: bool, subresources: tuple[str, ...] = (), shortnames=()) -> None:
        self.resources[key] = ResourceInfo(
            kind=kind, namespaced=namespaced, subresources=set(subresources), shortnames=set(shortnames),
            verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
        )
        if "status" in subresources:
            self._with_status.add(resource(key))

    def declare_crd(self, crd: dict) -> None:
        spec = crd["spec"]
        for version in spec["versions"]:
            self.declare(f"{spec['group']}/{version['name']}/{spec['names']['plural']}", spec["names"]["kind"],
                         spec["scope"] == "Namespaced", tuple((version.get("subresources") or {}).keys()),
                         spec["names"].get("shortNames", ()))
        self.objects[resource("apiextensions.k8s.io/v1/customresourcedefinitions"), None, crd["metadata"]["name"]] = crd

    def refuse(self, plural_key: str, status: int | None, verb: str = "create") -> None:
        """`verb` (create, patch, delete) requests of `plural_key` are answered `status` from now on (an API server in
        trouble with one resource; None: served again); their bodies are kept in `refusals`."""
        key = (resource(plural_key), {"create": action.CREATE, "patch": action.UPDATE, "delete": action.DELETE}[verb])
        if status is None:
            self._refused.pop(key, None)
        else:
            self._refused[key] = status

    # ---- writes ---------------------------------------------------------------------------------
    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def issue_token(self, namespace: str, service_account: str, pod: str | None = None, audience: str = "tensile",
                    seconds: float = 3600) -> str:
        """A service-account token as the kubelet projects one (`pod`: bound to that pod) or as TokenRequest gives."""
        token = "emu." + uuid.uuid4().hex + uuid.uuid4().hex
        self.tokens[token] = (f"system:serviceaccount:{namespace}:{service_account}", [audience], pod,
                              time.monotonic() + seconds)
        return token

    def _review(self, data: dict) -> dict:
        """The TokenReview's status for its spec: what the API server's service-account authenticator says."""
        spec = data.get("spec") or {}
        wanted = list(spec.get("audiences") or [])
        issued = self.tokens.get(spec.get("token") or "")
        if issued is None or issued[3] < time.monotonic():
            return {"authenticated": False, "error": "invalid bearer token, token has expired or is not valid"}
        username, audiences, pod, _ = issued
        common = [a for a in wanted if a in audiences] if wanted else audiences
        if not common:
            return {"authenticated": False, "error": "token audiences are invalid for the target audiences"}
        extra = {"authentication.kubernetes.io/pod-name": [pod], "authentication.kubernetes.io/pod-uid": [str(uuid.uuid5(
            uuid.NAMESPACE_DNS, pod))]} if pod else {}
        namespace = username.split(":")[2]
        return {"authenticated": True, "audiences": common,
                "user": {"username": username, "uid": str(uuid.uuid5(uuid.NAMESPACE_DNS, username)),
                         "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"],
                         "extra": extra}}

    async def _handle(self, request):  # type: ignore[no-untyped-def]
        if request.resource == resource("authentication.k8s.io/v1/tokenreviews") and request.action == action.CREATE:
            self.token_reviews += 1
            data = request.data if isinstance(request.data, dict) else {}
            return aiohttp.web.json_response({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                                              "metadata": {}, "spec": data.get("spec") or {}, "status": self._review(data)},
                                             status=201)
        if request.resource == resource("authorization.k8s.io/v1/subjectaccessreviews") and request.action == action.CREATE:
            spec = (request.data if isinstance(request.data, dict) else {}).get("spec") or {}
            attributes = spec.get("resourceAttributes") or {}
            users = self.pod_creators.get(attributes.get("namespace"))
            allowed = attributes.get("resource") == "pods" and (users is None or spec.get("user") in users)
            return aiohttp.web.json_response({"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                                              "spec": spec, "status": {"allowed": allowed}}, status=201)
        # kmock matches each request against its whole request history (quadratic in the requests served);
        # these tests never assert on that history, so only the request being served is kept.
        del self._requests[:-1]
        if request.resource is None or request.action not in (action.CREATE, action.UPDATE, action.DELETE):
            return await super()._handle(request)
        async with self._write_lock:
            try:
                self._refuse(request)
                request = self._prepare(request)
            except KubernetesError as exc:
                return await self._render_error(exc)
            if request.action == action.DELETE and (terminating := await self._unconfirmed(request)) is not None:
                return aiohttp.web.json_response(terminating)
            if request.action == action.CREATE and request.resource == resource(PODS):
                await self._schedule(request.data)
            response = await super()._handle(request)
            if request.resource in (resource(PODS), resource(RESOURCE_CLAIMS)):
                claim_deleted = request.action == action.DELETE and request.resource == resource(RESOURCE_CLAIMS)
                await self._release_claims(claim_deleted)
            return response

    def _refuse(self, request) -> None:  # type: ignore[no-untyped-def]
        status = self._refused.get((request.resource, request.action))
        if status is not None:
            self.refusals.append(copy.deepcopy(request.data))
            raise KubernetesError(status, "InternalError", f"refused by the test: {request.resource}")

    def _current(self, request) -> Any:  # type: ignore[no-untyped-def]
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return self.objects[key]

    def _prepare(self, request):  # type: ignore[no-untyped-def]
        if request.action == action.CREATE:
            data = copy.deepcopy(request.data or {})
            meta = data.setdefault("metadata", {})
            if request.namespace:
                meta["namespace"] = request.namespace
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            meta.update(uid=str(uuid.uuid4()), resourceVersion=self._next_rv(), generation=1,
                        creationTimestamp=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            return _with_data(request, data)
        current = self._current(request)
        if current is None:
            return request  # kmock answers 404
        raw = current.raw
        if request.action == action.DELETE:
            preconditions = (request.data or {}).get("preconditions") or {} if isinstance(request.data, dict) else {}
            for field, name in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
                if preconditions.get(field) is not None and preconditions[field] != raw["metadata"].get(field):
                    raise KubernetesError(409, "Conflict", f"Precondition failed: {name} in precondition: "
                                                           f"{preconditions[field]}, {name} in object meta: {raw['metadata'].get(field)}")
            current.patch({"metadata": {"resourceVersion": self._next_rv()}})
            return request
        status_only = request.subresource == "status"
        with_status = request.resource in self._with_status
        patch = request.data
        if isinstance(patch, list):  # JSON patch (Kopf's progress and status fallbacks)
            ops = [op for op in patch if op.get("op") == "test"]
            for op in ops:
                try:
                    jsonpatch.apply_patch(raw, [op])
                except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException):
                    raise KubernetesError(422, "Invalid", f"the test of {op.get('path')} failed") from None
            body_ops = [op for op in patch if op.get("op") != "test"]
            if with_status:
                body_ops = [op for op in body_ops if op["path"].startswith("/status") == status_only]
            try:
                new = jsonpatch.apply_patch(raw, body_ops)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                raise KubernetesError(422, "Invalid", str(exc)) from None
        else:
            patch = copy.deepcopy(patch or {})
            wanted = (patch.get("metadata") or {}).pop("resourceVersion", None)
            if wanted is not None and wanted != raw["metadata"].get("resourceVersion"):
                raise KubernetesError(409, "Conflict", "the object has been modified; apply your changes to the latest version")
            if with_status:
                patch = {"status": patch.get("status")} if status_only else {k: v for k, v in patch.items() if k != "status"}
                if status_only and patch["status"] is None:
                    patch = {}
            new = _merge(raw, patch)
        meta = new.setdefault("metadata", {})
        meta["resourceVersion"] = self._next_rv()
        if new.get("spec") != raw.get("spec"):
            meta["generation"] = int(raw["metadata"].get("generation", 1)) + 1
        # Hand kmock a merge patch that turns the stored object into `new` (kmock merges dicts).
        return _with_data(request, _diff(raw, new))

    async def _unconfirmed(self, request) -> dict | None:  # type: ignore[no-untyped-def]
        """A graceful deletion of a running or pending pod on an `unreachable` node: marked terminating (deletionTimestamp,
        deletionGracePeriodSeconds; a MODIFIED event) and kept, as the API server keeps it until its kubelet confirms.
        None: removed at once (no grace period, not bound, ended, or a kubelet that confirms)."""
        current = self._current(request)
        if current is None or request.resource != resource("v1/pods"):
            return None
        raw = current.raw
        grace = (request.data or {}).get("gracePeriodSeconds") if isinstance(request.data, dict) else None
        grace = (raw.get("spec") or {}).get("terminationGracePeriodSeconds", 30) if grace is None else int(grace)
        if grace == 0 or (raw.get("spec") or {}).get("nodeName") not in self.unreachable \
                or (raw.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            return None
        if not raw["metadata"].get("deletionTimestamp"):
            when = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=grace)
            current.patch({"metadata": {"deletionTimestamp": when.strftime("%Y-%m-%dT%H:%M:%SZ"),
                                        "deletionGracePeriodSeconds": grace}})
            async with self._lock:
                await self._buses[request.resource].put({"type": "MODIFIED", "object": copy.deepcopy(current.raw)})
        return copy.deepcopy(current.raw)

    # ---- dynamic resource allocation --------------------------------------------------------------
    async def _schedule(self, pod: dict) -> bool:
        """Allocates the claims of an unbound pod and binds it to their node (`pod` is changed in place), else marks it
        Unschedulable with the scheduler's message. Whether it was bound."""
        spec = pod.setdefault("spec", {})
        names = [c.get("resourceClaimName") for c in spec.get("resourceClaims") or []]
        if spec.get("nodeName") or not names:
            return False
        namespace = pod["metadata"]["namespace"]
        claims = {n: self.get(RESOURCE_CLAIMS, namespace, n) for n in names if n}
        allocator = Allocator(self.items(RESOURCE_SLICES), self.items(DEVICE_CLASSES), self.items(RESOURCE_CLAIMS))
        try:
            missing = [n for n, c in claims.items() if c is None]
            if missing:
                raise Unallocatable(f'resourceclaim "{missing[0]}" not found')
            allocations = {n: c["status"]["allocation"] if (c.get("status") or {}).get("allocation")
                           else allocator.allocate(c) for n, c in claims.items() if c is not None}
        except Unallocatable as exc:
            pod["status"] = {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
                                                                 "reason": "Unschedulable", "message": str(exc)}]}
            return False
        node = ""
        for name, allocation in allocations.items():
            node = allocation["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"][0]
            claim = self.objects[resource(RESOURCE_CLAIMS), namespace, name]
            reserved = list((claim.raw.get("status") or {}).get("reservedFor") or [])
            reserved.append({"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]})
            await self._write(RESOURCE_CLAIMS, claim, {"status": {"allocation": allocation, "reservedFor": reserved}})
        spec["nodeName"] = node
        pod["status"] = {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]}
        return True

    async def _write(self, plural_key: str, obj: Any, patch: dict) -> None:
        """An object changed by the emulator's own controllers, with its new resourceVersion and a MODIFIED event."""
        obj.patch(patch | {"metadata": {"resourceVersion": self._next_rv()}})
        async with self._lock:
            await self._buses[resource(plural_key)].put({"type": "MODIFIED", "object": copy.deepcopy(obj.raw)})

    async def _release_claims(self, freed: bool = False) -> None:
        """Claims reserved for pods that are gone or finished are released (deallocated when none is left), and the
        unbound pods that wait for claims are scheduled again once anything was."""
        # read in place, not through `items` (a deep copy of every pod, after every pod write: quadratic in the pods,
        # and in the process of the operator under test, whose admissions waited for it)
        claims, pods = resource(RESOURCE_CLAIMS), resource(PODS)
        reserving, live = [], set()
        for (res, _, _), obj in self.objects.items():
            if obj.deleted:  # a soft-deleted object has no raw form
                continue
            status = obj.raw.get("status") or {}
            if res == claims and status.get("reservedFor"):
                reserving.append(obj)
            elif res == pods and status.get("phase") not in ("Succeeded", "Failed"):
                live.add(obj.raw["metadata"]["uid"])
        for obj in reserving:
            reserved = obj.raw["status"]["reservedFor"]
            kept = [r for r in reserved if r.get("uid") in live]
            if len(kept) != len(reserved):
                freed = freed or not kept
                await self._write(RESOURCE_CLAIMS, obj, {"status": {"reservedFor": kept or None} | (
                    {} if kept else {"allocation": None})})
        if freed:
            await self.schedule_waiting()

    async def schedule_waiting(self) -> None:
        """Unbound pods with claims tried again (as the scheduler retries them when resources free)."""
        for (res, _, _), obj in list(self.objects.items()):
            if res != resource(PODS) or obj.deleted or (obj.raw.get("spec") or {}).get("nodeName"):
                continue
            pod = copy.deepcopy(obj.raw)
            if await self._schedule(pod):
                await self._write(PODS, obj, {"spec": {"nodeName": pod["spec"]["nodeName"]}, "status": pod["status"]})

    def device_overcommits(self) -> list[str]:
        """Devices whose allocated claims consume more of a capacity than the device has (never, if DRA holds)."""
        used = consumption(self.items(RESOURCE_CLAIMS))
        return [f"{d.name}: {name} {amount} > {d.capacity[name]['value']}"
                for d in devices_of(self.items(RESOURCE_SLICES)) for name, amount in used.get(d.key, {}).items()
                if name in d.capacity and amount > parse_quantity(d.capacity[name]["value"])]

    # ---- reads ----------------------------------------------------------------------------------
    async def _serve_list(self, request):  # type: ignore[no-untyped-def]
        result = await super()._serve_list(request)
        selector = _selector(request.params.get("labelSelector"))
        result["items"] = [o for o in result["items"] if selector(o)]
        result["metadata"]["resourceVersion"] = str(self._rv)
        return result

    async def _serve_watch(self, request):  # type: ignore[no-untyped-def]
        yield b""
        selector = _selector(request.params.get("labelSelector"))
        since = _rv_of({"metadata": {"resourceVersion": request.params.get("resourceVersion")}})
        bus = self._buses[request.resource]
        marker = await bus.mark()  # subscribe first: nothing that happens during the replay is lost
        try:
            async with self._lock:
                replay = [{"type": "ADDED", "object": copy.deepcopy(obj.raw)}
                          for (res, ns, name), obj in self.objects.items()
                          if res == request.resource and not obj.deleted and self._matches(request, ns, name)]
            sent: dict[tuple, int] = {}
            for event in replay:  # a watch from resourceVersion N sends what changed after N
                if selector(event["object"]) and _rv_of(event["object"]) > since:
                    sent[_key_of(event["object"])] = _rv_of(event["object"])
                    yield event
            async for event in bus.stream(since=marker):
                meta = (event.get("object") or {}).get("metadata") or {}
                if self._matches(request, meta.get("namespace"), meta.get("name")) and selector(event["object"]):
                    if event.get("type") != "DELETED" and _rv_of(event["object"]) <= max(since, sent.get(_key_of(event["object"]), 0)):
                        continue  # already replayed, or older than the watch's start
                    yield event
        finally:
            await bus.unmark(marker)

    @staticmethod
    def _matches(request, namespace, name) -> bool:  # type: ignore[no-untyped-def]
        return (request.namespace is None or namespace == request.namespace) and (request.name is None or name == request.name)

    # ---- conveniences for tests -----------------------------------------------------------------
    def get(self, plural_key: str, namespace: str | None, name: str) -> dict | None:
        key = (resource(plural_key), namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    def new_items(self, plural_key: str, seen: set[str]) -> list[dict]:
        """Objects whose uid is not in `seen` (copied); cheap to poll."""
        res = resource(plural_key)
        return [copy.deepcopy(o.raw) for (r, _, _), o in list(self.objects.items())
                if r == res and not o.deleted and o.raw["metadata"].get("uid") not in seen]

    def items(self, plural_key: str) -> list[dict]:
        res = resource(plural_key)
        return [copy.deepcopy(o.raw) for (r, _, _), o in list(self.objects.items()) if r == res and not o.deleted]


def _rv_of(obj: dict) -> int:
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:
        return 0


def _key_of(obj: dict) -> tuple:
    meta = obj.get("metadata") or {}
    return meta.get("namespace"), meta.get("name")


def _with_data(request, data):  # type: ignore[no-untyped-def]
    """kmock identifies a request by its object (its views hold it), so the parsed body is replaced in place."""
    object.__setattr__(request, "data", data)
    return request


def _merge(base: dict, patch: dict) -> dict:
    """RFC 7386 JSON merge patch."""
    result = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = _merge(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def _diff(old: dict, new: dict) -> dict:
    """A merge patch taking `old` to `new`."""
    patch: dict = {}
    for key in old:
        if key not in new:
            patch[key] = None
    for key, value in new.items():
        if key not in old:
            patch[key] = copy.deepcopy(value)
        elif isinstance(value, dict) and isinstance(old[key], dict):
            sub = _diff(old[key], value)
            if sub:
                patch[key] = sub
        elif value != old[key]:
            patch[key] = copy.deepcopy(value)
    return patch


def _selector(text: str | None):  # type: ignore[no-untyped-def]
    """Equality-based label selectors: a=b, a!=b, a, !a (comma-separated, all must hold)."""
    terms = [t.strip() for t in (text or "").split(",") if t.strip()]

    def match(obj: dict) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        for term in terms:
            if "!=" in term:
                k, v = term.split("!=", 1)
                if labels.get(k) == v:
                    return False
            elif "=" in term:
                k, v = term.replace("==", "=").split("=", 1)
                if labels.get(k) != v:
                    return False
            elif term.startswith("!"):
                if term[1:] in labels:
                    return False
            elif term not in labels:
                return False
        return True

    return match
