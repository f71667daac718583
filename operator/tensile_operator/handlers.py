"""Kopf handlers, registered on a registry of their own so that several operator runs can share a process."""

from __future__ import annotations

import logging
import os
from typing import Any, TypedDict

import kopf

from tensile.errors import TensileUserError
from tensile_operator import GROUP, VERSION
from tensile_operator.app import OperatorApp
from tensile.knobs import ANNOTATION_PREFIX, KNOBS
from tensile_operator.pods import JOB_LABEL
from tensile_operator.validation import check, leaves_the_job_alone, tensilenode_writer_problem
from tensile_operator.validation import trainingjob_writer_problem
from tensile_operator.validation import warnings as admission_warnings

PEERING = "tensile"


class _Resource(TypedDict):
    """The keywords that point a kopf.on decorator at a resource on our registry."""

    group: str
    version: str
    plural: str
    registry: kopf.OperatorRegistry


def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In a pod: the service account; elsewhere: $KUBECONFIG or ~/.kube/config."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def webhook_server() -> kopf.WebhookServer | None:
    """TENSILE_WEBHOOK_PORT turns the validating webhook on: TLS from TENSILE_WEBHOOK_CERT/KEY, or plain HTTP
    with TENSILE_WEBHOOK_INSECURE=1 (tests, or behind a TLS-terminating proxy)."""
    port = os.environ.get("TENSILE_WEBHOOK_PORT")
    if not port:
        return None
    return kopf.WebhookServer(
        addr=os.environ.get("TENSILE_WEBHOOK_ADDR", "0.0.0.0"),
        port=int(port),
        insecure=os.environ.get("TENSILE_WEBHOOK_INSECURE") == "1",
        certfile=os.environ.get("TENSILE_WEBHOOK_CERT") or None,
        pkeyfile=os.environ.get("TENSILE_WEBHOOK_KEY") or None,
    )


def build_registry(app: OperatorApp, webhook: kopf.WebhookServer | None = None, metrics_port: int = 0,
                   metrics_addr: str = "0.0.0.0") -> kopf.OperatorRegistry:
    """`metrics_port`: serve /metrics there while the operator runs (0: off)."""
    registry = kopf.OperatorRegistry()
    tj: _Resource = {"group": GROUP, "version": VERSION, "plural": "trainingjobs", "registry": registry}

    @kopf.on.login(registry=registry)
    async def _login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        info = login(**kwargs)
        if info is not None:
            app.kube.login(info)
        return info

    @kopf.on.startup(registry=registry)
    async def _startup(settings: kopf.OperatorSettings, **kwargs: Any) -> None:
        settings.peering.name = PEERING
        settings.peering.mandatory = True
        settings.persistence.finalizer = "tensile.dev/release-gpu"
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="operator.tensile.dev")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="operator.tensile.dev", key="last-handled-configuration")
        settings.watching.server_timeout = 300
        # Kopf's own Events only for problems, not every handler run; a job's lifecycle Events are posted by
        # events.EventRecorder (kopf.event has no event queue in the scheduler's and background tasks)
        settings.posting.level = logging.WARNING
        if webhook is not None:
            settings.admission.server = webhook
        info = login(settings=settings)
        if info is not None:
            app.kube.login(info)
        if info is None:
            raise kopf.PermanentError("no Kubernetes credentials: no service account and no kubeconfig")
        try:
            app.metrics.serve(metrics_port, metrics_addr)
        except TensileUserError as exc:
            raise kopf.PermanentError(str(exc)) from exc
        await app.scheduler.load_priority_classes()  # before the watch below starts: the first pass orders by them
        await app.start()

    @kopf.on.cleanup(registry=registry)
    async def _cleanup(**_: Any) -> None:
        app.metrics.close()
        await app.stop()

    if webhook is not None:
        @kopf.on.validate(**tj, id="tensile-validate", operations=["CREATE", "UPDATE"])
        async def _validate(spec: kopf.Spec, meta: kopf.Meta, warnings: list[str], **cause: Any) -> None:
            if cause.get("operation") == "UPDATE" and leaves_the_job_alone(cause.get("old"), cause.get("new")):
                return
            await _may_create_its_pod(cause.get("userinfo") or {}, meta.get("namespace") or "")
            warnings.extend(admission_warnings(dict(meta.annotations)))  # kubectl prints them; the job is not refused
            # the class may be created later: the job waits for it
            warnings.extend(app.scheduler.priorities.warnings(dict(spec)))
            problems = await check(dict(spec), dict(meta.annotations), app.capacity.gpus, app.forecaster,
                                   namespace=meta.get("namespace") or "")
            if problems:
                raise kopf.AdmissionError("; ".join(str(p) for p in problems), code=422)

    if webhook is not None:
        agents = {a for a in os.environ.get("TENSILE_AGENT_ACCOUNTS", "").split(",") if a}

        @kopf.on.validate(GROUP, VERSION, "tensilenodes", registry=registry, id="tensile-nodes",
                          operations=["CREATE", "UPDATE"], subresource="*")
        async def _node_writer(name: str, **cause: Any) -> None:
            problem = tensilenode_writer_problem(cause.get("userinfo") or {}, name, agents)
            if problem:
                raise kopf.AdmissionError(problem, code=403)

        @kopf.on.validate(**tj, id="tensile-job-writers", operations=["CREATE", "UPDATE"], subresource="*")
        async def _job_writer(**cause: Any) -> None:
            user = cause.get("userinfo") or {}
            problem = trainingjob_writer_problem(user, cause.get("old"), cause.get("new"), agents)
            if problem:
                raise kopf.AdmissionError(problem, code=403)

    async def _may_create_its_pod(user: dict, namespace: str) -> None:
        """The operator creates the job's pod (with the service account its template names) with its own rights: only
        who may create pods in the namespace may have it do so."""
        try:
            allowed = await app.kube.may_create_pods(user, namespace)
        except Exception as exc:  # noqa: BLE001 - refused, not admitted unchecked
            raise kopf.AdmissionError(f"cannot check that {user.get('username')} may create pods in namespace "
                                      f"{namespace} ({exc}): try again", code=503) from None
        if not allowed:
            raise kopf.AdmissionError(f"{user.get('username')} may not create pods in namespace {namespace}: a "
                                      "TrainingJob's pod is created for whoever creates or edits it, so they need that "
                                      "right", code=403)

    @kopf.on.resume(**tj, id="readmit")
    @kopf.on.create(**tj, id="admit")
    async def _admit(body: kopf.Body, **_: Any) -> None:
        await app.intake.admit(_plain(body))

    @kopf.on.event(**tj)
    async def _placed(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
        if event.get("type") != "DELETED":
            app.capacity.adopt(_plain(body))

    @kopf.on.field(**tj, id="knobs", field="metadata.annotations")
    async def _knobs(body: kopf.Body, old: Any, new: Any, reason: str, **_: Any) -> None:
        old, new = dict(old or {}), dict(new or {})
        knobs = {knob.annotation for knob in KNOBS}
        changed = {k for k in old.keys() | new.keys() if k.startswith(ANNOTATION_PREFIX) and old.get(k) != new.get(k)}
        if reason != "update" or not changed:
            return
        if changed & knobs:
            await app.edits.knobs_changed(_plain(body))
        else:  # only names that are no knob (a misspelt one added, fixed or removed): the job's condition says so
            await app.edits.annotations_changed(_plain(body))

    # on updates only: as a field handler it also ran at creation, a second handler of the creation, so an operator
    # stopped between the two left Kopf resuming the creation without `admit` (done), and the job never queued
    @kopf.on.update(**tj, id="spec", field="spec")
    async def _spec(body: kopf.Body, **_: Any) -> None:
        # after the knobs: an edit of both is forecast by the edited spec with the new knobs
        await app.edits.spec_changed(_plain(body))

    @kopf.on.delete(**tj, id="release")
    async def _release(body: kopf.Body, **_: Any) -> None:
        await app.follower.deleted(_plain(body))

    @kopf.on.event("", "v1", "pods", labels={JOB_LABEL: kopf.PRESENT}, registry=registry)
    async def _pod(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
        await app.follower.pod_changed(_plain(body), deleted=event.get("type") == "DELETED")

    @kopf.on.event("scheduling.k8s.io", "v1", "priorityclasses", registry=registry)
    async def _priority_class(event: kopf.RawEvent, body: kopf.Body, name: str, **_: Any) -> None:
        app.scheduler.priority_class_changed(None if event.get("type") == "DELETED" else _plain(body), name)

    @kopf.on.event(GROUP, VERSION, "tensilenodes", registry=registry)
    async def _node(event: kopf.RawEvent, body: kopf.Body, name: str, **_: Any) -> None:
        await app.node_changed(None if event.get("type") == "DELETED" else _plain(body), name)

    if app.access.dra:  # legacy mode reads no ResourceSlice (a cluster without DRA has none, and grants none)
        @kopf.on.event("resource.k8s.io", "v1", "resourceslices", registry=registry)
        async def _slice(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
            await app.slice_changed(_plain(body), deleted=event.get("type") == "DELETED")

    return registry


def _plain(body: kopf.Body) -> dict[str, Any]:
    """A Kopf body as a plain dict (our code keeps and copies it)."""
    import copy

    return copy.deepcopy(dict(body))
