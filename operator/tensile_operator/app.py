"""One operator run: its collaborators built and wired, started and stopped.

Flow (docs/operator.md): `JobIntake` (validate, forecast, queue) -> `Scheduler` (place, book, write the placement) ->
`PodLauncher` (the pod) -> `PodFollower` (the pod followed, the job deleted) -> `JobCompletion` (the end written, the
room released), all on the `CapacityLedger`; `Replacement` places again a job whose GPU went, `Readmission` admits a
restarted agent's jobs again, and `JobEdits` takes a job's edits. The Kopf handlers (`handlers.py`) call the
collaborator each event is for.
"""

from __future__ import annotations

import os

from tensile import trainingjob_spec as model
from tensile_operator.agent import NodeAgentClient
from tensile_operator.capacity import CapacityLedger
from tensile_operator.claims import GpuAccess, JobClaims
from tensile_operator.completion import JobCompletion
from tensile_operator.dra_inventory import DraInventory
from tensile_operator.edits import JobEdits
from tensile_operator.events import EventRecorder
from tensile_operator.following import PodFollower
from tensile_operator.forecasting import Forecaster
from tensile_operator.heap import freeze_long_lived
from tensile_operator.intake import JobIntake
from tensile_operator.kube import Kube
from tensile_operator.metrics import OperatorMetrics
from tensile_operator.placement import JointPlanner
from tensile_operator.pod_creation import PodLauncher
from tensile_operator.pods import DEFAULT_IMAGE, JobTokens
from tensile_operator.queueing import JobQueue, QueueConfig
from tensile_operator.readmission import Readmission
from tensile_operator.replacement import Replacement
from tensile_operator.scheduler import Scheduler
from tensile_operator.statuses import JobStatuses, job_key
from tensile_operator.tasks import Background


class OperatorApp:
    """`kube`, `agents`: the clients of the API server and of the node agents (tests give their own); `access`: the GPU
    access mode (default: from the environment, `GpuAccess.from_env`)."""

    def __init__(self, forecaster: Forecaster | None = None, planner: JointPlanner | None = None,
                 image: str | None = None, token_key: bytes | None = None, queueing: QueueConfig | None = None,
                 kube: Kube | None = None, agents: NodeAgentClient | None = None,
                 access: GpuAccess | None = None) -> None:
        queueing = queueing or QueueConfig.from_env()  # a bad setting stops the operator before it starts
        self.access = access or GpuAccess.from_env()
        self.kube = kube or Kube()
        self.events = EventRecorder(self.kube)
        self.forecaster = forecaster or Forecaster()
        self.planner = planner or JointPlanner()
        self.agents = agents or NodeAgentClient()
        self.background = Background()
        tokens = JobTokens(token_key)
        self.statuses = JobStatuses(self.kube, self.events)
        self.metrics = OperatorMetrics(self.statuses.phase_snapshot)
        dra = self.access.dra
        inventory = DraInventory(self.kube, self.access) if dra else None
        self.capacity = CapacityLedger(self.kube, self.forecaster, inventory)
        self.queue = JobQueue()
        claims = JobClaims(self.kube, self.access) if dra else None
        self.completion = JobCompletion(self.capacity, self.queue, self.statuses, self.agents, self.forecaster, tokens,
                                        self.background, claims)
        image = image or os.environ.get("TENSILE_IMAGE", DEFAULT_IMAGE)
        self.pods = PodLauncher(self.kube, self.capacity, self.statuses, self.events, self.agents, tokens,
                                self.completion, self.background, image, claims)
        self.intake = JobIntake(self.capacity, self.queue, self.statuses, self.pods, self.completion, self.forecaster,
                                self.metrics)
        self.scheduler = Scheduler(self.kube, self.capacity, self.queue, self.statuses, self.pods, self.completion,
                                   self.planner, queueing, self.metrics)
        self.edits = JobEdits(self.capacity, self.queue, self.statuses, self.intake, self.agents, tokens,
                              self.background)
        self.replacement = Replacement(self.kube, self.capacity, self.statuses, self.scheduler, self.pods,
                                       self.completion, self.intake, self.edits, self.background)
        self.follower = PodFollower(self.kube, self.capacity, self.queue, self.statuses, self.pods, self.completion,
                                    self.replacement, tokens)
        self.readmission = Readmission(self.kube, self.capacity, self.statuses, self.pods)

    async def node_changed(self, body: dict | None, name: str) -> None:
        """A TensileNode published, updated or removed (`body` None): the jobs booked there are checked against what
        it lists now (`Replacement.check_node`), and admitted again by a restarted agent (`Readmission`)."""
        self.capacity.set_node(body, name)
        self.queue.poke()
        await self.capacity.ready.wait()
        await self.replacement.check_node(name)
        await self.readmission.node_changed(body, name)

    async def slice_changed(self, body: dict, deleted: bool) -> None:
        """`dra` mode: a ResourceSlice published, changed or deleted (its watch): the jobs booked on its node are
        checked against the GPUs the slices publish now (`Replacement.check_node`), and waiting jobs see its GPUs."""
        self.capacity.slice_changed(None if deleted else body, body["metadata"]["name"])
        self.queue.poke()
        await self.capacity.ready.wait()
        await self.replacement.check_node(body["spec"].get("nodeName", ""))

    async def start(self) -> None:
        """Rebuild from the cluster, then run the scheduler (Kopf startup)."""
        for node in await self.kube.list_tensilenodes():
            self.capacity.set_node(node, node["metadata"]["name"])
            self.queue.poke()
        await self.capacity.refresh_dra()  # `dra` mode: what the slices publish, for the GPUs that went meanwhile
        listed = await self.completion.rebuild_ledger()
        self.capacity.ready.set()
        await self.replacement.check_nodes_at_start(listed)
        self.background.spawn(self.replacement.recheck_forever())
        # seen while the LIST was in flight: it may predate their placement
        finished = {job_key(b) for b in listed if (b.get("status") or {}).get("phase") in model.FINISHED}
        self.capacity.adopt_early(finished)
        freeze_long_lived()
        self.scheduler.start()

    async def stop(self) -> None:
        await self.scheduler.stop()
        await self.background.cancel(self.scheduler.task)
        await self.events.close()
        await self.kube.close()
