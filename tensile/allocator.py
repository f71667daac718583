"""A model of PyTorch's CUDA caching allocator, run over one job's allocations and frees: the memory the process
*reserves* (its segments), which is what decides an out-of-memory error on a shared GPU, beside the bytes its
tensors hold (what tensile.peak forecasts).

The rules, read from PyTorch's c10/cuda/CUDACachingAllocator.cpp (class DeviceCachingAllocator; newer releases
share the generic parts in c10/core/CachingDeviceAllocator.h) and the constants of c10/core/AllocatorConfig.h,
at the default settings (no max_split_size_mb, roundup_power2_divisions or garbage collection; no empty_cache):

- a request is rounded up to a multiple of 512 B (`round_size`; tensile.workload.round_allocation);
- requests of at most 1 MiB are served from the small pool, larger ones from the large pool (`get_pool`);
- a request takes the smallest cached free block of its pool that fits, the lowest address among equal sizes
  (`get_free_block`: the free blocks are kept ordered by size, then address);
- when none fits, a new segment (`alloc_block`, `get_allocation_size`): 2 MiB for a small request, 20 MiB for a
  request under 10 MiB, else the request rounded up to a multiple of 2 MiB;
- the block is split when what remains is worth keeping (`should_split`): at least 512 B in the small pool, more
  than 1 MiB in the large pool; the request takes the low end (`alloc_found_block`);
- a freed block merges with the free blocks beside it in its segment (`free_block`, `try_merge_blocks`);
- segments are never given back (that needs empty_cache or an allocation failing), so reserved memory only grows;
- `memory_allocated` counts the blocks handed out (`alloc_found_block`: `allocated_bytes` grows by the block's size),
  so a large block whose rest of at most 1 MiB was not split off counts whole; the rounded requests are
  `requested_bytes`, what the tensors hold.

With expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; Note [Expandable Segments],
`find_expandable_block`, `map_block`, `try_allocate_expandable_block`): each pool has one segment, a range of
address space mapped to memory at its end as needed, in pages of 2 MiB (small pool) or 20 MiB (large pool;
`large_segment_size` in c10/core/AllocatorConfig.h). A request that no free block fits maps the pages it lacks after
the segment's free tail and takes the two together; best fit passes the tail over while any other free block fits
(`get_free_block`'s `expandable_size`); any remainder of at least 512 B is split off, in both pools.

The cuBLAS workspaces (tensile.cublas_workspaces) are requests like the tensors', made when their op first runs and
never freed.

Left out: streams (the hook allocates swap-ins on the compute stream, so one stream holds every block), frees that
wait for another stream's events (`record_stream`), CUDA graphs' private pools, the retry path after a failed
cudaMalloc (it frees cached segments: a run that needs it is already at the cap), cuDNN's workspaces (see
tensile.cublas_workspaces) and memory outside the allocator (the CUDA context).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tensile.peak import FREE, Change, effective_changes, scheduled_changes, vanilla_changes
from tensile.plan import Plan
from tensile.workload import CUDA_BLOCK_BYTES, Workload, round_allocation

MIB = 1 << 20
SMALL_SIZE = MIB  # kSmallSize: the largest request of the small pool
SMALL_BUFFER = 2 * MIB  # kSmallBuffer: a small pool's segment, and its page when segments expand
LARGE_BUFFER = 20 * MIB  # kLargeBuffer: the segment of a request under kMinLargeAlloc, the large pool's page
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc
ROUND_LARGE = 2 * MIB  # kRoundLarge: larger requests get a segment of their size rounded up to this
LARGE_POOL_BASE = 1 << 50  # where the large pool's addresses start: its blocks sort apart from the small pool's
MAX_ITERATIONS = 8  # iterations replayed at most while the allocator's state at an iteration start keeps changing


# the allocator's settings, by the variable PyTorch reads first where both are set (c10/core/AllocatorConfig.cpp: the
# device-generic PYTORCH_ALLOC_CONF since 2.9, else PYTORCH_CUDA_ALLOC_CONF)
ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def _options(value: str) -> dict[str, str]:
    """An allocator setting's options ('max_split_size_mb:128,expandable_segments:True') by name."""
    pairs = (option.partition(":") for option in value.split(",") if option.strip())
    return {key.strip(): setting.strip() for key, _, setting in pairs}


def expandable_segments_setting(environ: Mapping[str, str | None]) -> dict[str, str]:
    """The allocator variable a job's environment gets so that its CUDA memory grows in expandable segments (less
    fragmentation: what it reserves stays nearer what its tensors hold, which a shared GPU's neighbours pay for),
    merged with the user's own setting and never overriding it. Empty where nothing is to be set: the user's setting
    names expandable_segments already (an explicit False stands), picks another backend (cudaMallocAsync has no
    segments), or cannot be read here (None: a pod's value from a ConfigMap or Secret)."""
    for name in ALLOC_CONF_VARIABLES:
        if name not in environ:
            continue
        value = environ[name]
        if value is None:
            return {}
        options = _options(value)
        if "expandable_segments" in options or options.get("backend", "native") != "native":
            return {}
        kept = [option.strip() for option in value.split(",") if option.strip()]
        return {name: ",".join([*kept, EXPANDABLE_SEGMENTS])}
    return {ALLOC_CONF_VARIABLES[1]: EXPANDABLE_SEGMENTS}


def expandable_segments_in(environ: Mapping[str, str]) -> bool:
    """Whether a job started from `environ` by Tensile (`expandable_segments_setting` merged in) runs with expandable
    segments: what its reserved memory is forecast with."""
    return expandable_segments_on({**environ, **expandable_segments_setting(environ)})


def expandable_segments_on(environ: Mapping[str, str]) -> bool:
    """Whether a process running with `environ` has expandable segments, as PyTorch reads its variables: what the
    hook tells the node agent of its own process."""
    name = next((name for name in ALLOC_CONF_VARIABLES if name in environ), None)
    return name is not None and _options(environ[name]).get("expandable_segments", "").lower() == "true"


def segment_bytes(size: int) -> int:
    """The segment a rounded request gets when no cached block fits it (`get_allocation_size`)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(slots=True, eq=False)
class Block:
    """A piece of one segment, free or handed out; `prev` and `next` are its neighbours in the segment."""

    address: int
    size: int
    small: bool
    free: bool = True
    requested: int = 0  # the rounded request it serves (0 while free)
    prev: Block | None = None
    next: Block | None = None


class _Pool:
    """One of the two pools: its segments (by their first block) and its free blocks ordered by (size, address)."""

    def __init__(self, small: bool, expandable: bool, base: int) -> None:
        self.small = small
        self.expandable = expandable
        self.reserved = 0
        self._end = base  # where the next segment starts (expandable: the end of the one segment's mapped pages)
        self._heads: list[Block] = []
        self._free: list[tuple[int, int]] = []
        self._free_at: dict[int, Block] = {}
        self._last: Block | None = None  # expandable: the block at the end of the mapped pages

    def take(self, size: int) -> Block:
        """A block for a rounded request: the best cached fit, else new memory; split when the rest is worth it."""
        block = self._best_fit(size) or self._grow(size)
        if self._worth_splitting(block.size - size):
            self._split(block, size)
        block.free = False
        return block

    def give_back(self, block: Block) -> None:
        """Cache a freed block, merged with the free blocks beside it (the lower one absorbs the higher)."""
        block.free, block.requested = True, 0
        if block.prev is not None and block.prev.free:
            lower = block.prev
            self._unlist(lower)
            self._absorb(lower, block)
            block = lower
        if block.next is not None and block.next.free:
            higher = block.next
            self._unlist(higher)
            self._absorb(block, higher)
        self._list(block)

    def layout(self) -> tuple[tuple[int, int, bool], ...]:
        """Every block as (address, size, free), segment by segment: the pool's state."""
        blocks = []
        for head in self._heads:
            block: Block | None = head
            while block is not None:
                blocks.append((block.address, block.size, block.free))
                block = block.next
        return tuple(blocks)

    def _best_fit(self, size: int) -> Block | None:
        at = bisect.bisect_left(self._free, (size, -1))
        if at == len(self._free):
            return None
        tail = self._last
        if tail is not None and tail.free and self._free[at][1] == tail.address and at + 1 < len(self._free):
            at += 1  # expandable: the tail can grow, so any other block that fits comes first
        _, address = self._free.pop(at)
        return self._free_at.pop(address)

    def _worth_splitting(self, rest: int) -> bool:
        """`should_split`: a large pool without expandable segments keeps remainders of 1 MiB or less attached."""
        if self.small or self.expandable:
            return rest >= CUDA_BLOCK_BYTES
        return rest > SMALL_SIZE

    def _grow(self, size: int) -> Block:
        """New memory: a segment of its own, or pages mapped at the end of the expandable segment."""
        if not self.expandable:
            block = Block(self._end, segment_bytes(size), self.small)
            self._heads.append(block)
            self._end += block.size
            self.reserved += block.size
            return block
        page = SMALL_BUFFER if self.small else LARGE_BUFFER
        tail = self._last if self._last is not None and self._last.free else None
        mapped = -(-(size - (tail.size if tail else 0)) // page) * page
        self.reserved += mapped
        self._end += mapped
        if tail is not None:
            self._unlist(tail)
            tail.size += mapped
            return tail
        block = Block(self._end - mapped, mapped, self.small, prev=self._last)
        if self._last is None:
            self._heads.append(block)
        else:
            self._last.next = block
        self._last = block
        return block

    def _split(self, block: Block, size: int) -> None:
        rest = Block(block.address + size, block.size - size, self.small, prev=block, next=block.next)
        if block.next is not None:
            block.next.prev = rest
        block.next, block.size = rest, size
        if self._last is block:
            self._last = rest
        self._list(rest)

    def _absorb(self, lower: Block, higher: Block) -> None:
        lower.size += higher.size
        lower.next = higher.next
        if higher.next is not None:
            higher.next.prev = lower
        if self._last is higher:
            self._last = lower

    def _list(self, block: Block) -> None:
        bisect.insort(self._free, (block.size, block.address))
        self._free_at[block.address] = block

    def _unlist(self, block: Block) -> None:
        del self._free[bisect.bisect_left(self._free, (block.size, block.address))]
        del self._free_at[block.address]


class CachingAllocator:
    """PyTorch's CUDA caching allocator on one device and stream: requests in, blocks out, segments kept."""

    def __init__(self, expandable_segments: bool = False) -> None:
        self._small = _Pool(True, expandable_segments, 0)
        self._large = _Pool(False, expandable_segments, LARGE_POOL_BASE)
        self.requested = self.peak_requested = 0  # rounded requests: torch.cuda's requested_bytes
        self.allocated = self.peak_allocated = 0  # blocks handed out: torch.cuda.memory_allocated
        self.peak_reserved = 0

    @property
    def reserved(self) -> int:
        """Bytes held in segments (mapped pages with expandable segments): torch.cuda.memory_reserved."""
        return self._small.reserved + self._large.reserved

    def malloc(self, nbytes: int) -> Block:
        size = round_allocation(nbytes, "cuda")
        block = (self._small if size <= SMALL_SIZE else self._large).take(size)
        block.requested = size
        self.requested += size
        self.allocated += block.size
        self.peak_requested = max(self.peak_requested, self.requested)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def free(self, block: Block) -> None:
        self.requested -= block.requested
        self.allocated -= block.size
        (self._small if block.small else self._large).give_back(block)

    def layout(self) -> tuple[tuple[tuple[int, int, bool], ...], ...]:
        """Both pools' blocks: equal layouts serve the same requests the same way."""
        return self._small.layout(), self._large.layout()


@dataclass(frozen=True, slots=True)
class AllocatorPeaks:
    """What the allocator model forecasts for a run of a job's iterations."""

    requested_peak_bytes: int  # the most the requests hold at once (rounded): the tensors' peak, as tensile.peak counts it
    allocated_peak_bytes: int  # the most the blocks handed out hold at once (torch.cuda.max_memory_allocated)
    reserved_peak_bytes: int  # the most the allocator holds in segments (torch.cuda.max_memory_reserved)
    iterations: int  # iterations replayed: until one started as an earlier one had (from there on they repeat)


def reserved_peak(workload: Workload, plan: Plan | None = None, bandwidth: float | None = None,
                  slowdown: float = 1.0, expandable_segments: bool = False,
                  workspaces: Mapping[int, int] | None = None) -> AllocatorPeaks:
    """Run the allocator model over the job's iterations, vanilla or under `plan` (whose swaps need the host link's
    `bandwidth`, as tensile.peak.analyze_plan does): the requested, allocated and reserved peaks. `workspaces` (op
    index -> bytes, tensile.cublas_workspaces) are allocated after that op's outputs the first time it runs and held
    from then on.

    Memory changes as Algorithm 1 sees them (tensile.peak): swap-outs and releases free, swap-ins and recomputes
    allocate again. The first iteration starts from an empty allocator that is given the resident tensors (in id
    order); between iterations, what the next one does not start with is freed and what it starts with but lacks is
    allocated. Iterations are replayed until one starts in a state an earlier one started in, at most
    MAX_ITERATIONS: a later iteration may find the cache laid out differently and need more segments."""
    if plan is None:
        changes, start = vanilla_changes(workload), workload.resident
    elif bandwidth is None:
        raise ValueError("a plan's swaps need the host link bandwidth to be placed")
    else:
        changes, start = scheduled_changes(workload, plan.events, bandwidth, slowdown)
    return _replay(workload, changes, start, CachingAllocator(expandable_segments), workspaces or {})


def _replay(workload: Workload, changes: list[Change], start: Iterable[int],
            allocator: CachingAllocator, workspaces: Mapping[int, int]) -> AllocatorPeaks:
    tensors = workload.tensors
    first = sorted(start)
    held: dict[int, Block] = {}  # tensor id -> its block
    pending = sorted(workspaces.items(), reverse=True)  # (op index, bytes), the next one last
    seen: set[tuple] = set()
    iterations = 0
    while iterations < MAX_ITERATIONS:
        _begin_iteration(workload, allocator, held, first)
        state = (allocator.layout(), tuple(sorted((t, block.address) for t, block in held.items())))
        if state in seen:
            break
        seen.add(state)
        iterations += 1
        alive = set(held)
        for change, taken_over in effective_changes(workload, changes, alive):
            while pending and change.time > pending[-1][0]:  # op i's outputs come at time i, its frees after
                allocator.malloc(pending.pop()[1])
            if change.kind == FREE:
                allocator.free(held.pop(change.tensor))
            elif taken_over is not None:
                held[change.tensor] = held.pop(taken_over)
            else:
                held[change.tensor] = allocator.malloc(tensors[change.tensor].size)
        while pending:  # ops after the iteration's last change of memory
            allocator.malloc(pending.pop()[1])
    return AllocatorPeaks(allocator.peak_requested, allocator.peak_allocated, allocator.peak_reserved, iterations)


def _begin_iteration(workload: Workload, allocator: CachingAllocator, held: dict[int, Block], start: list[int]) -> None:
    """Bring the held tensors to what an iteration starts with. An updated tensor (a parameter, an optimizer state)
    starts the next iteration under its first name, in the same memory."""
    wanted = set(start)
    kept: dict[int, Block] = {}
    for tensor, block in held.items():
        first = _first_name(workload, tensor)
        if first in wanted and first not in kept:
            kept[first] = block
        else:
            allocator.free(block)
    held.clear()
    for tensor in start:
        held[tensor] = kept[tensor] if tensor in kept else allocator.malloc(workload.tensors[tensor].size)


def _first_name(workload: Workload, tensor: int) -> int:
    """The tensor whose memory `tensor` took over, back to the first (itself if it took none over)."""
    while (previous := workload.tensors[tensor].reuses) is not None:
        tensor = previous
    return tensor
