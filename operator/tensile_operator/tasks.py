"""The operator's background tasks: pod creations, profile fetches, looks at jobs whose GPU went, retried knobs."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class Background:
    """Keeps each task referenced until it ends (the event loop holds only weak references), so that the operator's
    stop cancels and awaits them all."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def cancel(self, *others: asyncio.Task | None) -> None:
        """Every background task and `others` (the scheduler's) cancelled, and awaited."""
        tasks = [*(t for t in others if t is not None), *self.tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
