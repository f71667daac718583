"""Where the hooked run stands, shared by the executor's parts (`executor.py` wires them)."""

from __future__ import annotations

import logging

import torch

from tensile_hook.active_plan import ActivePlan
from tensile_hook.report import HookReport, IterationStats
from tensile.knobs import budget_bytes
from tensile_hook.settings import HookSettings

log = logging.getLogger("tensile.hook")


class RunState:
    """The iteration, its figures and plan, the step and the path, the budget, and whether the hook stood down.

    The dispatch path reads several of these on every op and the native path's hooks at every module call, so they
    are plain attributes one lookup away. Beside each, the parts that write it; the others only read it. What the
    hook says goes into the report once, with the iteration it was first said in (`say`)."""

    def __init__(self, settings: HookSettings, device: torch.device, report: HookReport) -> None:
        self.settings = settings
        self.device = device
        # read at every step and iteration start: torch.device's `type` makes its str anew in C++ on each read (18 µs
        # on the caches a step's optimizer leaves, where the interpreter's own steps cost under 1 µs)
        self.device_type: str = device.type
        self.report = report
        self.said: set[str] = set()  # messages said so far (`say`)
        self.iteration = 0  # Iterations
        # Iterations; its figures by every part, its mode also by whatever leaves the plan or stands down
        self.stats = IterationStats(0)
        self.match_at = 1  # the iteration whose recording is matched against the plan (0 is a warm-up): Iterations
        self.in_step = 0  # optimizer steps under way, and whether one ran since the iteration began: Iterations
        self.step_done = False
        # the plan applied in this iteration: Iterations; dropped by DispatchPath at a divergence, by Paths where
        # another dispatch mode holds the stack, by a stand-down
        self.active: ActivePlan | None = None
        # the last iteration ran under a plan, so its next-iteration events fire in this one: Iterations
        self.previous_planned = False
        # plan tensor id -> id(storage), positional each iteration: DispatchPath binds, Iterations forgets (new shapes)
        self.keys: dict[int, int] = {}
        self.op_index = 0  # position in the iteration (fast path): DispatchPath; Iterations starts it at 0
        self.in_mode = False  # the dispatch mode on the stack: Paths
        self.path = "dispatch"  # this iteration's path: Paths
        self.next_path = "dispatch"  # decided at the optimizer step for the next iteration: Paths
        # a budget in bytes (what the job was admitted with) holds from the first op; a fraction waits for the
        # vanilla peak: PlanBook
        self.budget: int | None = budget_bytes(settings.memory_budget, 0) if (settings.memory_budget or 0) > 1 else None
        report.memory_budget_bytes = self.budget
        self.disabled = False  # stood down (or in a forked child): PlanExecutor
        # the exception that ended the script, by its type's name (sys.excepthook, before the exit's report): lifecycle
        self.ended_by: str | None = None

    def say(self, message: str, level: int = logging.WARNING) -> None:
        """Said once, with the iteration it was first said in; a repeat is only counted (a GAN's other step
        diverging every second iteration said the same warning, and added it to the report, each time)."""
        report = self.report
        if message in self.said:
            report.repeated[message] = report.repeated.get(message, 0) + 1
            log.debug("tensile: (again) %s", message)
            return
        self.said.add(message)
        log.log(level, "tensile: %s", message)
        report.messages.append(f"iteration {self.iteration}: {message}")

    def start_due(self) -> bool:
        """After the step(s), outside any step and backward, with grad enabled: a training forward may start."""
        return (self.step_done and self.in_step == 0 and torch.is_grad_enabled()
                and torch._C._current_autograd_node() is None)
