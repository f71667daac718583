"""The hook's link to its node agent (TENSILE_AGENT): register, get the plan, report, unregister.

The executor offers two extension points, and this module fills both: `planner` (called with the
live workload after iteration 1, and with each one recorded anew: a re-plan, new shapes) and `listener`
(called after every iteration). Every HTTP call runs in one background thread, so the training loop
never waits on the agent except for `planner`, which waits at most `agent_wait` seconds for the agent's
first plan and otherwise falls back (the local planner, or guarded) and adopts the agent's plan when it
arrives. An agent that is down, slow or refusing costs the training nothing but that wait: the last plan
is kept, and the report's messages and the log say so.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from tensile.agent_client import AgentClient, AgentError
from tensile.agent_contract import FAILED, MAX_OP_SAMPLES, ContractError, Measurements, PlanResponse
from tensile.knobs import budget_bytes, memory_text
from tensile.plan import Plan, plan_from_data, plan_problems, rebind, summary
from tensile_hook.allocator_settings import allocator_settings, training_device
from tensile_hook.latency_samples import OpSamples
from tensile_hook.memory_cap import MemoryCap
from tensile_hook.plan_book import Planner
from tensile_hook.report import HookReport, IterationStats
from tensile_hook.settings import HookSettings, native_plans
from tensile.workload import Workload

log = logging.getLogger("tensile.hook")
FIRST_PLAN_POLL_SECONDS = 0.02
# refusals of a registration that can pass later (the operator's admission of the pod not there yet, its projected
# token not written yet): the link backs off and tries again instead of giving the agent up
CREDENTIAL_NOT_YET = ("not_admitted", "missing_credential", "bad_credential")


@dataclass
class _Registration:
    """What the background thread is asked to send: a registration, or the live workload as an upload."""

    workload: Workload
    budget: int | None
    upload: bool


class AgentLink:
    def __init__(self, settings: HookSettings, client: AgentClient, fallback: Planner | None = None,
                 environ: Mapping[str, str] | None = None, memory_cap: MemoryCap | None = None) -> None:
        self.settings = settings
        self.client = client
        self.fallback = fallback
        self.environ = os.environ if environ is None else environ  # the process's: what its allocator reads
        # the cap sitecustomize set on the process's CUDA memory (None: none), whose allocator share the agent is told
        self.memory_cap = memory_cap
        self._lock = threading.Condition()
        self._todo: _Registration | None = None
        self._pending: list[IterationStats] = []
        # op latencies to post (op indices, seconds), the newest MAX_OP_SAMPLES
        self._sampled: tuple[list[int], list[float]] = ([], [])
        self._signature: str | None = None  # the workload whose plans the hook applies
        # the workload the agent plans on (registered or uploaded) and the live one the executor binds plans
        # with: equal signatures, but a forecast numbers its tensors in its own order (see tensile.plan.rebind)
        self._planned_on: Workload | None = None
        self._live: Workload | None = None
        self._response: PlanResponse | None = None  # the latest plan response for that signature
        self._handed: int | None = None  # the plan version last given to the executor
        self._refused: str | None = None  # the agent refused the job: no more calls
        self._notes: list[str] = []  # for the report, written by the training thread
        self._reachable = True
        self._registrations = 0
        # whether this process trains (a module call with gradients on, an iteration): until then a registration waits.
        # A script that starts the training as a process of its own runs the hook too and trains nothing (or checks the
        # model under no_grad); registered, it held the job's name under a token the agent gave it, and the training's
        # own registration was refused (403)
        self._trains = False
        self._device: int | None = None  # the CUDA device the training thread works on, once it trains
        self._first_call: RemovableHandle | None = None
        self._registering = False  # a registration went out (or was tried), which the exit undoes
        self._matched: bool | None = None  # the forecast workload's signature against the live one, to report
        self._match_posted: bool | None = None  # the same, for the agent (sent with every post once known)
        self._source: str | None = None  # plan source to put in the report at the next listener call
        self._waiting = False  # the training thread waits for the first plan: poll fast
        self._fetch_forecast = False  # the first round asks the agent for the forecast workload (TENSILE_SIGNATURE)
        self._last_error: str | None = None
        self._bad_plan: str | None = None  # why the agent's latest plan was refused (checked as a plan file is)
        self._failing: str | None = None  # the link's last round failed (a malformed answer): it backs off and retries
        # the first plan response saying the GPU cannot fit its jobs (version, the agent's message), said once after
        # the executor took that plan (and with it the plan's budget); then None, and `_unfit_said`
        self._unfit: tuple[int, str] | None = None
        self._unfit_said = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tensile-agent-link", daemon=True)

    @classmethod
    def from_env(cls, settings: HookSettings, fallback: Planner | None = None,
                 environ: dict[str, str] | None = None, memory_cap: MemoryCap | None = None) -> AgentLink:
        client = AgentClient.from_env(environ, timeout=settings.agent_timeout, max_backoff=settings.agent_max_backoff)
        return cls(settings, client, fallback, environ, memory_cap)

    def start(self, workload: Workload | None = None) -> AgentLink:
        """Begin; with the forecast workload (TENSILE_WORKLOAD) the job registers at its first module call, so the
        agent plans while the first iterations run. With only its signature (TENSILE_SIGNATURE: a pod the operator
        placed, which registered the job with its forecast at admission) the first round fetches that workload
        from the agent and registers with it, as soon. Otherwise it registers the live one after iteration 1."""
        if workload is not None:
            self._register_forecast(workload)
        else:
            self._fetch_forecast = self.settings.signature is not None
        self._first_call = register_module_forward_pre_hook(self._module_called)
        self._thread.start()
        return self

    def _module_called(self, module: torch.nn.Module, args: Any) -> None:
        """A module call with gradients on trains; one without (a launcher's summary or sanity check, an evaluation
        before training) does not yet, and the pre-hook stays for the next call."""
        if torch.is_grad_enabled():
            self._set_training()

    def _set_training(self) -> None:
        """This process trains (a module's forward with gradients, or an iteration's end): a registration waiting for it
        goes out. The global pre-hook goes at once: while any is there, every module call takes PyTorch's slow path."""
        handle, self._first_call = self._first_call, None
        if handle is not None:
            handle.remove()
        device = training_device()
        with self._lock:
            self._trains = True
            self._device = device
            self._lock.notify_all()

    def _register_forecast(self, workload: Workload) -> None:
        budget = budget_bytes(self.settings.memory_budget, _vanilla_peak(workload)) if self.settings.memory_budget else None
        self._todo = _Registration(workload, budget, upload=False)
        self._signature = workload.signature
        self._planned_on = workload

    # -- the executor's extension points (training thread) ---------------------------------------
    def planner(self, live: Workload, budget: int | None) -> Plan | None:
        """The agent's plan for the live workload, waited for at most `agent_wait` seconds; else the
        fallback's plan (version 0, so the agent's plan replaces it as soon as it comes)."""
        with self._lock:
            if self._live is None and self._signature is not None:  # registered with the forecast: did it match?
                self._matched = self._match_posted = self._signature == live.signature
            self._live = live
            if self._signature != live.signature:
                # registered with another workload (a stale forecast, or the batch's shapes changed since): upload the
                # live one instead; the agent plans the shapes uploaded last, the executor keeps earlier shapes' plans
                unsent = self._todo is not None and not self._todo.upload
                upload = self._signature is not None and not unsent
                self._todo = _Registration(live, budget, upload=upload)
                self._signature = live.signature
                self._planned_on = live
                self._response = None
            self._waiting = True
            self._lock.notify_all()
            # the latest plan for this workload, handed before or not: one the listener handed while the
            # executor was still recording (registered with the forecast, the agent plans that early) was
            # dropped there, since the executor applies plans only once it has matched the live iteration
            self._lock.wait_for(lambda: self._plan_ready(again=True) or self._given_up(), timeout=self.settings.agent_wait)
            self._waiting = False
            plan = self._take_plan(again=True)
        plan = self._onto_live(plan)
        if plan is not None:
            self._source = "agent"
            return plan
        response = self._response
        failed = response is not None and response.status == FAILED
        unreachable = "it is unreachable" if not self._reachable else None  # its error is in the note before
        why = (self._refused or unreachable or self._failing or self._bad_plan or self.client.last_error
               or (response.message if response is not None and failed else None)
               or f"no plan within {self.settings.agent_wait:g} s")
        if self.fallback is None:
            self._note(f"node agent gave no plan ({why}): running guarded until it does")
            return None
        self._note(f"node agent gave no plan ({why}): planning locally until it does")
        plan = self.fallback(live, budget)
        if plan is not None:
            plan.version = 0  # any agent plan is newer
            self._handed = 0
            self._source = "local"
        return plan

    def listener(self, stats: IterationStats, report: HookReport, samples: OpSamples | None = None) -> Plan | None:
        """Queue this iteration's figures (and a sampling iteration's op latencies, for the workload the agent plans
        with) for the agent and hand over a newer plan if one came."""
        if self._source is not None:
            report.plan_source, self._source = self._source, None
        if self._matched is not None:
            report.signature_match, self._matched = self._matched, None
        if not self._trains:  # a training of no module calls
            self._set_training()
        with self._lock:
            self._pending.append(stats)
            if samples is not None and samples.signature == self._signature:
                indices, seconds = self._sampled
                self._sampled = (indices + samples.indices)[-MAX_OP_SAMPLES:], (seconds + samples.seconds)[-MAX_OP_SAMPLES:]
            self._say_unfit(report)  # before a plan handed now: the executor takes its budget after this call
            plan = self._onto_live(self._take_plan())
            notes, self._notes = self._notes, []
        for note in notes:
            log.warning("tensile: %s", note)
            report.messages.append(f"iteration {stats.iteration}: {note}")
        return plan

    def close(self) -> None:
        """At exit: the last figures, then unregister, all within `agent_timeout` seconds (the background thread's call
        in flight, then one attempt each, no retry, on one deadline), saying what was not delivered. With retries and a
        join of its own, an agent that accepted connections and never answered held the exit 7.7 s."""
        if self._first_call is not None:  # no module ran: the hook goes with the link (tests activate the hook again)
            self._first_call.remove()
            self._first_call = None
        if not self._thread.is_alive():
            return
        deadline = time.monotonic() + self.settings.agent_timeout
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
            figures = f"the figures of the last {len(self._pending)} iterations" if self._pending else None
        self._thread.join(self.settings.agent_timeout)
        if self._refused is not None:
            self.client.close()
            return
        # a process that never sent a registration (it trained nothing: a starter) has nothing to unregister
        unregistration = "the unregistration" if self._registering else None
        if self._thread.is_alive():  # its call holds the client until its own timeout: nothing more can go out
            undelivered = [what for what in (figures, unregistration) if what is not None]
        else:
            undelivered = [what for what, call in ((figures, self._flush), (unregistration, self.client.unregister))
                           if what is not None and not self._once(call, what, deadline)]
            self.client.close()
        if undelivered:
            log.warning("tensile: not delivered to the node agent at exit (no answer within %g s): %s; an agent drops a "
                        "job of its own that stays silent (--expire-silent-jobs)", self.settings.agent_timeout,
                        ", ".join(undelivered))

    def _once(self, call: Callable[[], bool], what: str, deadline: float) -> bool:
        """One attempt at an exit call, no retry, in the time left before `deadline`; False when it did not go out."""
        http = self.client.http
        http.retries = 0
        http.close()  # a new connection takes the time left as its timeout
        http.timeout = deadline - time.monotonic()
        if http.timeout <= 0:
            return False
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - exiting: say so, never raise into the user's exit
            log.warning("tensile: at exit, the node agent refused %s: %s", what, exc)
            return True  # it answered

    # -- helpers under the lock ------------------------------------------------------------------
    def _plan_ready(self, again: bool = False) -> bool:
        """A plan for the hook's workload not handed to the executor yet (`again`: handed or not). A failed
        round's response keeps the job's last plan, which after an upload was made for another workload."""
        response = self._response
        return (response is not None and response.plan is not None and response.plan.get("signature") == self._signature
                and (again or response.version != self._handed))

    def _given_up(self) -> bool:
        response = self._response
        return (self._refused is not None or not self._reachable or self._failing is not None
                or (self._bad_plan is not None and not self._plan_ready(again=True))
                or (response is not None and response.status == FAILED))

    def _take_plan(self, again: bool = False) -> Plan | None:
        if not self._plan_ready(again):
            return None
        assert self._response is not None
        self._handed = self._response.version
        return self._response.plan_object()

    def _say_unfit(self, report: HookReport) -> None:
        """Once, the agent's word that its GPU cannot fit its jobs (the plan is the best it found), with the budget the
        guard holds this job to: said after the executor took that plan, and with it the plan's budget (the agent
        holds each job to its share when they do not fit). Before, it reached only the agent's /v1/jobs."""
        unfit = self._unfit
        if unfit is None or self._handed is None or self._handed < unfit[0]:
            return
        self._unfit, self._unfit_said = None, True
        budget = report.memory_budget_bytes
        guard = (f"the budget guard keeps this job under {memory_text(budget)}" if budget
                 else "no budget is set: give --memory-budget")
        self._notes.append(f"the node agent cannot fit this GPU's jobs: {unfit[1]}; {guard}")

    def _onto_live(self, plan: Plan | None) -> Plan | None:
        """The agent's plan in the live iteration's tensor ids, once the executor has matched it (before, or with
        a plan file, the executor binds plans with the workload they were made for)."""
        if plan is None or self._live is None or self._planned_on is None:
            return plan
        rebound = rebind(plan, self._planned_on, self._live)
        if rebound is None:
            self._notes.append(f"the agent's plan version {plan.version} does not map onto the live iteration's "
                               "tensors: ignored")
        return rebound

    def _note(self, message: str) -> None:
        with self._lock:
            self._notes.append(message)

    # -- the background thread ----------------------------------------------------------------------
    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                self._round()
            except Exception as exc:  # noqa: BLE001 - the link may fail, the training may not
                failures += 1
                self._failed(exc, failures)
            else:
                if failures:
                    failures = 0
                    self._note("the agent link works again")
                    with self._lock:
                        self._failing = None
            with self._lock:
                if failures:
                    pause = min(self.settings.agent_interval * 2 ** failures, max(self.settings.agent_max_backoff,
                                                                                  self.settings.agent_interval))
                else:
                    pause = FIRST_PLAN_POLL_SECONDS if self._waiting else self.settings.agent_interval
                self._lock.wait(pause)

    def _failed(self, exc: Exception, failures: int) -> None:
        """A round that failed (an answer that breaks the contract, an agent gone wrong): said once, then the link backs
        off and tries again. It ended the link for good, so one malformed answer cost the job the agent for its run."""
        message = f"the agent link failed ({type(exc).__name__}: {exc})"
        with self._lock:
            self._failing = message
            if failures == 1:
                self._notes.append(f"{message}; trying again, backing off up to {self.settings.agent_max_backoff:g} s; "
                                   "training goes on with the plan it has")
            self._lock.notify_all()

    def _round(self) -> None:
        if self._fetch_forecast:
            self._fetch_forecast = False
            self._take_forecast()
        with self._lock:
            todo, self._todo = (self._todo, None) if self._trains else (None, self._todo)
            self._registering = self._registering or todo is not None
        if self._refused is not None:
            return
        if todo is not None:
            try:
                self._send(todo)
            except Exception as exc:  # noqa: BLE001 - sorted below; the rest goes to the backoff in `_run`
                if isinstance(exc, (AgentError, ContractError)) and getattr(exc, "code", None) not in CREDENTIAL_NOT_YET:
                    self._refuse_job(exc)
                    return
                with self._lock:  # not sent, or not yet accepted: tried again at the next round
                    self._todo = self._todo or todo
                raise
        self._flush()
        response = self.client.fetch_plan() if self.client.registration is not None else None
        self._observe()
        with self._lock:
            plan = response.plan if response is not None else None
            if response is not None and isinstance(plan, dict) and plan.get("signature") == self._signature:
                self._take_response(response)
            elif response is not None and response.status == FAILED:
                self._response = response
            self._lock.notify_all()

    def _take_response(self, response: PlanResponse) -> None:
        """The agent's plan for this workload, kept when it passes the checks a plan file passes (under the lock). One
        that does not is refused, said once: the job keeps its last good plan (or plans locally, or runs guarded).
        Unchecked, an unknown event kind or a budget of "lots" made the hook stand down for the rest of the run."""
        refusal = self._plan_refusal(response)
        if refusal is None:
            self._response, self._bad_plan = response, None
            if not self._unfit_said:  # the latest word counts: a neighbour may have left since
                self._unfit = (response.version, response.message) if response.fits is False else None
            return
        message = f"the node agent's plan version {response.version!r} is refused: {refusal}"
        if message != self._bad_plan:
            self._bad_plan = message
            self._notes.append(f"{message}; the job keeps the plan it has (or plans locally, or runs guarded) until a "
                               "good one comes")

    def _plan_refusal(self, response: PlanResponse) -> str | None:
        """Why the agent's plan cannot run for the workload it was asked for, checked as a plan file is; None when it can."""
        if not isinstance(response.version, int) or isinstance(response.version, bool) or response.version < 0:
            return f"its version {response.version!r} is not a whole number"
        try:
            plan = plan_from_data(response.plan)
        except ValueError as exc:
            return f"it is no plan ({exc})"
        problems = plan_problems(plan, self._planned_on) if self._planned_on is not None else []
        return summary(problems) if problems else None

    def _refuse_job(self, exc: Exception) -> None:
        self._refuse(f"node agent refused the job ({exc}); training goes on without it" + {
            "wrong_token": "; give this run another --job NAME (TENSILE_JOB)",
            "unknown_gpu": "; name one of its GPUs with --gpu UUID|INDEX (TENSILE_GPU)",
        }.get(getattr(exc, "code", None) or "", ""))

    def _take_forecast(self) -> None:
        """The workload the operator registered the job with, as if TENSILE_WORKLOAD had named it; unless the
        agent has none of that signature (the operator could not reach it: the live one is registered after
        iteration 1, as without) or the executor asked for a plan meanwhile (it registers the live one)."""
        signature = self.settings.signature
        try:
            workload = self.client.workload()
        except (AgentError, ContractError, ValueError) as exc:
            log.info("tensile: the node agent has no forecast workload for the job (%s): registering the live one after iteration 1", exc)
            return
        if workload is None or workload.signature != signature:
            log.info("tensile: the node agent %s: registering the live workload after iteration 1",
                     "is unreachable" if workload is None else f"holds a workload of signature {workload.signature}, not {signature}")
            return
        with self._lock:
            if self._live is None and self._todo is None and self._signature is None:
                self._register_forecast(workload)

    def _send(self, todo: _Registration) -> None:
        if todo.upload:
            self.client.upload_workload(todo.workload)
        else:
            # the operator gives every pod it places a token; a job without one came by itself. The agent
            # plans with the events this hook's own planner would use (on CUDA, what the native path carries),
            # forecasts what the process reserves with its allocator's settings, and shows the allocator's cap beside it
            expandable, workspace = allocator_settings(todo.workload.device, self.environ, self._device)
            cap = self.memory_cap.allocator_bytes if self.memory_cap is not None else None
            self.client.register(workload=todo.workload, memory_budget_bytes=todo.budget,
                                 max_swap_rate=self.settings.max_swap_rate, recompute=self.settings.recompute,
                                 external=self.settings.token is None,
                                 activations_only=native_plans(self.settings, todo.workload.device),
                                 expandable_segments=expandable, cublas_workspace_bytes=workspace,
                                 allocator_cap_bytes=cap)

    def _flush(self) -> bool:
        """Post what the iterations since the last post measured, with the op latencies sampled meanwhile (dropped if
        the agent is away); False when there was something and it did not go out."""
        with self._lock:
            pending, self._pending = self._pending, []
            (indices, seconds), self._sampled = self._sampled, ([], [])
        if not pending or self.client.registration is None:
            return not pending
        figures = [{"mode": s.mode, "peak_bytes": s.peak_bytes, "peak_source": s.peak_source, "seconds": s.seconds,
                    "stall_seconds": s.stall_seconds, "swap_out_bytes": s.swap_out_bytes, "swap_in_bytes": s.swap_in_bytes,
                    "recompute_bytes": s.recompute_bytes, "plan_version": s.plan_version,
                    "reserved_bytes": s.reserved_bytes, "out_of_memory_retries": s.out_of_memory_retries}
                   for s in pending]
        samples: list[list[float]] = [[index, s] for index, s in zip(indices, seconds)]
        measurements = Measurements.from_iterations(figures, op_latencies=samples, signature_match=self._match_posted)
        return self.client.post_measurements(measurements) is not None

    def _observe(self) -> None:
        """Turn the client's state changes into messages: gone, back, registered again."""
        client = self.client
        if client.reachable != self._reachable:
            self._reachable = client.reachable
            if client.reachable:
                self._note("node agent answers again")
            else:
                self._note(f"node agent unreachable ({client.last_error}); keeping plan version {client.plan_version}")
        if client.registrations > self._registrations:
            if self._registrations:
                self._note(f"registered again with the node agent (it restarted, or dropped the job after a silence): registration {client.registrations}")
            self._registrations = client.registrations
        if client.reachable and client.last_error != self._last_error:
            self._last_error = client.last_error
            if client.last_error:  # it answered, but refused a call (e.g. its GPU is gone)
                self._note(f"node agent: {client.last_error}")

    def _refuse(self, message: str) -> None:
        with self._lock:
            self._refused = message
            self._notes.append(message)
            self._lock.notify_all()


def _vanilla_peak(workload: Workload) -> int:
    from tensile.peak import analyze_vanilla

    return analyze_vanilla(workload).peak_bytes
