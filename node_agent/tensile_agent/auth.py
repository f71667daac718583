"""Who is calling the agent, and what a registration may claim.

A registration names a job and takes a share of a GPU's memory from every job beside it, so the agent asks who
sends it (the `Authorization: Bearer` credential) before anything else:

- in a cluster (`kubernetes`): a service-account token with the audience `tensile`, verified with the TokenReview
  API. The operator's own service account may admit and register any job; any other token must be bound to a pod
  (the kubelet's projected token names it), and that pod may register only the job the operator admitted with that
  pod's name, onto one of this agent's GPUs, in the pod's namespace;
- in local mode (`secret`): the secret the local runner made and handed its jobs (a file only its user reads);
- `none`: no credential asked (an agent on loopback for its own user, and tests of everything but this).

A caller that proves nothing is answered 401; one that proves who it is but may not do this, 403; registrations past
the caps per GPU and per namespace, 429.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tensile_agent.problems import Problem

log = logging.getLogger("tensile_agent.auth")
AUDIENCE = "tensile"  # the audience of the tokens jobs and the operator present to agents
POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
OPERATOR, POD, LOCAL = "operator", "pod", "local"
MODES = ("kubernetes", "secret", "none")


@dataclass(frozen=True)
class Caller:
    """Who sent a call, as its credential proved: the operator, a pod (its namespace and name) or the local user."""

    kind: str
    user: str = ""
    namespace: str | None = None
    pod: str | None = None


class Authenticator(Protocol):
    def identify(self, authorization: str | None) -> Caller: ...


def bearer(authorization: str | None) -> str:
    """The credential of an `Authorization: Bearer` header; 401 without one."""
    scheme, _, credential = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not credential.strip():
        raise Problem(401, "missing_credential", "this call needs a credential: 'Authorization: Bearer <token>' (in a "
                                                 "pod the hook sends its projected service-account token)")
    return credential.strip()


class NoCredential:
    """Every caller is the local user (an agent started with --auth none)."""

    def identify(self, authorization: str | None) -> Caller:
        return Caller(LOCAL)


class SharedSecret:
    """The local runner's secret: whoever holds it is the local user."""

    def __init__(self, secret: str) -> None:
        if len(secret) < 16:
            raise ValueError("the agent's credential must be at least 16 characters")
        self._digest = hashlib.sha256(secret.encode()).digest()

    def identify(self, authorization: str | None) -> Caller:
        given = hashlib.sha256(bearer(authorization).encode()).digest()
        if not hmac.compare_digest(given, self._digest):
            raise Problem(401, "bad_credential", "the credential is not this agent's")
        return Caller(LOCAL)


class TokenReviewer:
    """Service-account tokens verified by the API server (TokenReview, audience `tensile`); answers are kept for
    `cache_seconds` (by the token's hash), so a hook's registrations after the first cost the API server nothing.
    `review(token)`: the TokenReview's status (a dict), `create_token_review` through `api` when not given."""

    def __init__(self, operator_accounts: set[str], api: Any = None, cache_seconds: float = 30.0,
                 review: Callable[[str], dict] | None = None, cache_size: int = 4096) -> None:
        self.operator_accounts = operator_accounts
        self.api = api
        self.cache_seconds = cache_seconds
        self.cache_size = cache_size
        self._review = review or self._token_review
        self._cache: dict[bytes, tuple[float, dict]] = {}
        self._lock = threading.Lock()

    def _token_review(self, token: str) -> dict:
        if self.api is None:
            from kubernetes import client, config

            config.load_incluster_config()
            self.api = client.AuthenticationV1Api()
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                "spec": {"token": token, "audiences": [AUDIENCE]}}
        review = self.api.create_token_review(body)
        status = review.get("status") if isinstance(review, dict) else review.to_dict().get("status")
        return status or {}

    def status(self, token: str) -> dict:
        key = hashlib.sha256(token.encode()).digest()
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and now - cached[0] < self.cache_seconds:
                return cached[1]
        try:
            status = self._review(token)
        except Exception as exc:  # noqa: BLE001 - the API server away: no one is proved, and nothing fails
            log.warning("TokenReview failed: %s", exc)
            raise Problem(503, "auth_unavailable", "the agent cannot verify credentials now (the API server did not "
                                                   "answer its TokenReview): try again") from None
        with self._lock:
            if len(self._cache) >= self.cache_size:
                self._cache.clear()
            self._cache[key] = (now, status)
        return status

    def identify(self, authorization: str | None) -> Caller:
        status = self.status(bearer(authorization))
        if not status.get("authenticated") or AUDIENCE not in (status.get("audiences") or [AUDIENCE]):
            raise Problem(401, "bad_credential", "the token is not valid for this agent (expired, forged, or not "
                                                 f"of the audience '{AUDIENCE}')")
        user = status.get("user") or {}
        name = str(user.get("username") or "")
        if name in self.operator_accounts:
            return Caller(OPERATOR, name)
        prefix, _, rest = name.partition("system:serviceaccount:")
        namespace = rest.split(":", 1)[0] if not prefix and rest else None
        pods = (user.get("extra") or {}).get(POD_NAME_EXTRA) or []
        if namespace is None or len(pods) != 1:
            raise Problem(403, "not_a_pod", f"{name or 'the caller'} is neither the operator nor a pod's service "
                                            "account: only the pods the operator placed register jobs here")
        return Caller(POD, name, namespace, str(pods[0]))


@dataclass
class Admission:
    """The operator's word that `pod` runs `job` on this agent's `gpu`, with the job's token and the memory budget it
    was admitted with (the most the pod may register it with)."""

    pod: str
    gpu: str
    token: str
    budget: int | None = None


@dataclass(frozen=True)
class RegistrationLimits:
    per_gpu: int = 64  # jobs registered on one GPU: past it, planning rounds grow slow for every job there
    per_namespace: int = 32  # of those, one namespace's: the others' keep room on the GPU


def registrations_over(limits: RegistrationLimits, on_gpu: int, of_namespace: int, gpu: str, namespace: str) -> None:
    """429 with the reason when one more registration on `gpu` would pass a cap (`of_namespace`: its jobs there)."""
    if on_gpu >= limits.per_gpu:
        raise Problem(429, "too_many_jobs", f"GPU {gpu} has {on_gpu} jobs registered, the most this agent takes "
                                            f"(--max-jobs-per-gpu {limits.per_gpu})")
    if of_namespace >= limits.per_namespace:
        raise Problem(429, "too_many_jobs", f"namespace {namespace} has {of_namespace} jobs registered on GPU {gpu}, "
                                            f"the most one namespace may (--max-jobs-per-namespace {limits.per_namespace})")
