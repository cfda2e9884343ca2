"""A replay of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, default settings plus
expandable_segments and max_split_size_mb), in plain Python so a plan needs no torch: it turns a stream
of allocations and frees into the reserved bytes (`torch.cuda.memory_reserved`: cudaMalloc'd segments,
or mapped pages) and allocated bytes (`memory_allocated`: live blocks as rounded) torch would show.

One stream is assumed, as in a training step's compute stream: no block waits on another stream's
events, and every free block is reusable at once. Real cudaMalloc addresses are unknowable, so segments
get addresses in creation order; best fit's ties between equal-size blocks go to the older segment.
Not modelled: roundup_power2_divisions, garbage_collection_threshold, CUDA-graph private pools.
Simplified: past capacity_bytes, all wholly free segments are released at once (torch, with
max_split_size set, first frees only enough oversize blocks: release_available_cached_blocks); an
expandable segment gives back only the free pages at its end (torch also unmaps whole free pages inside
it, and later maps into those holes first); capacity counts the bytes a growth newly maps (torch's
set_per_process_memory_fraction check counts the get_allocation_size of the request).
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from trainplan.errors import ConfigError
from trainplan.spec.devices import MiB

MIN_BLOCK_SIZE = 512  # kMinBlockSize: every block is a multiple of it
SMALL_SIZE = MiB  # kSmallSize: the largest request served by the small pool
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: a small-pool segment; the small pool's page when expandable
LARGE_BUFFER = 20 * MiB  # kLargeBuffer: the segment of a 1-10 MiB request; the large pool's page when expandable
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: from here a request gets a segment of its own size
ROUND_LARGE = 2 * MiB  # kRoundLarge: what those own-size segments round up to
_EXPANDABLE_SPAN = 1 << 50  # an expandable segment's virtual range (torch reserves 1.125 x device memory)


def round_size(nbytes: int) -> int:
    """The block size torch hands out for a request of `nbytes` (round_size): a multiple of 512, at least 512."""
    return MIN_BLOCK_SIZE * max(1, -(-nbytes // MIN_BLOCK_SIZE))


def allocation_size(size: int) -> int:
    """The segment cudaMalloc'd for a rounded request no cached block fits (get_allocation_size)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-size // ROUND_LARGE)


@dataclass(frozen=True, kw_only=True)
class AllocatorConfig:
    """The PYTORCH_CUDA_ALLOC_CONF settings the replay honours, and the bytes the device can hand out."""

    expandable_segments: bool = False  # expandable_segments:True
    max_split_size: int | None = None  # bytes (max_split_size_mb * MiB); None: unlimited, torch's default
    capacity_bytes: int | None = None  # what cudaMalloc / cuMemCreate can hand out in all; None: unlimited

    def __post_init__(self) -> None:
        if self.max_split_size is not None and self.max_split_size < LARGE_BUFFER:
            raise ConfigError("max_split_size", f"{self.max_split_size} bytes is under 20 MiB", "raise it or use None")
        if self.capacity_bytes is not None and self.capacity_bytes <= 0:
            raise ConfigError("capacity_bytes", f"{self.capacity_bytes} is not positive", "give a byte count or None")


class OutOfMemory(Exception):
    """A request that no cached block fits and no new segment can hold, even after releasing the cache
    (torch's OutOfMemoryError). `requested` is the request's bytes, `reserved` what was left reserved."""

    def __init__(self, requested: int, reserved: int, capacity: int) -> None:
        self.requested, self.reserved, self.capacity = requested, reserved, capacity
        super().__init__(f"out of memory: {requested} bytes requested with {reserved} of {capacity} bytes reserved")


class SegmentInfo(NamedTuple):
    """One segment (for expandable segments: the mapped range) as torch.cuda.memory_snapshot() counts it."""

    size: int  # reserved bytes
    allocated_bytes: int  # bytes of its live blocks


class _Segment:
    __slots__ = ("address", "size", "pool", "last")

    def __init__(self, address: int, size: int, pool: _Pool) -> None:
        self.address, self.size, self.pool = address, size, pool
        self.last: _Block | None = None  # the highest-address block; blocks chain back from it by `prev`


class _Block:
    __slots__ = ("address", "size", "segment", "prev", "next", "allocated")

    def __init__(self, address: int, size: int, segment: _Segment, prev: _Block | None, next: _Block | None) -> None:
        self.address, self.size, self.segment = address, size, segment
        self.prev, self.next = prev, next
        self.allocated = False


class _Pool:
    __slots__ = ("small", "page", "free", "expandable")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.page = SMALL_BUFFER if small else LARGE_BUFFER  # ExpandableSegment's segment_size_
        self.free: list[tuple[int, int, _Block]] = []  # free blocks by (size, address): BlockPool::blocks
        self.expandable: _Segment | None = None  # the pool's one expandable segment, once made


class CachingAllocator:
    """The allocator's state: segments split into blocks, and each pool's free blocks sorted for best fit.
    Its figures, to read and not to set: reserved_bytes, allocated_bytes and their peaks."""

    def __init__(self, config: AllocatorConfig | None = None) -> None:
        self.config = config or AllocatorConfig()
        self.reserved_bytes = self.allocated_bytes = self.peak_reserved_bytes = self.peak_allocated_bytes = 0
        self._small, self._large = _Pool(small=True), _Pool(small=False)
        self._segments: dict[int, _Segment] = {}  # cudaMalloc'd segments by address (not expandable ones)
        self._live: dict[Hashable, _Block | None] = {}  # None: a 0-byte request, which holds no block
        self._next_address = 0

    @property
    def segments(self) -> list[SegmentInfo]:
        """Every segment holding reserved bytes, in address order."""
        segments = [*self._segments.values(), *(p.expandable for p in (self._small, self._large) if p.expandable)]
        infos = []
        for segment in sorted(segments, key=lambda s: s.address):
            allocated, block = 0, segment.last
            while block is not None:
                allocated += block.size if block.allocated else 0
                block = block.prev
            if segment.size:
                infos.append(SegmentInfo(segment.size, allocated))
        return infos

    def malloc(self, key: Hashable, nbytes: int) -> None:
        """Allocate `nbytes` under `key` as torch's malloc does; raise OutOfMemory past capacity_bytes."""
        if key in self._live:
            raise ValueError(f"alloc of key {key!r}, which is already live")
        if nbytes < 0:
            raise ValueError(f"alloc of key {key!r}: {nbytes} bytes is negative")
        if nbytes == 0:  # torch hands out no memory for an empty tensor
            self._live[key] = None
            return
        size = round_size(nbytes)
        pool = self._small if size <= SMALL_SIZE else self._large  # get_pool: the pools never share blocks
        block = self._get_free_block(pool, size) or self._alloc_block(pool, size)
        if block is None:
            assert self.config.capacity_bytes is not None
            raise OutOfMemory(nbytes, self.reserved_bytes, self.config.capacity_bytes)
        if self._should_split(pool, block, size):
            self._split(pool, block, size)
        block.allocated = True
        self._live[key] = block
        self.allocated_bytes += block.size
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)

    def free(self, key: Hashable) -> None:
        """Free `key`'s block: it merges with free neighbours of its segment and stays cached (free_block)."""
        try:
            block = self._live.pop(key)
        except KeyError:
            raise ValueError(f"free of key {key!r}, which is not live") from None
        if block is None:
            return
        block.allocated = False
        self.allocated_bytes -= block.size
        pool = block.segment.pool
        prev, nxt = block.prev, block.next  # try_merge_blocks with each; other segments are never neighbours
        if prev is not None and not prev.allocated:
            self._remove_free(pool, prev)
            block.address, block.size, block.prev = prev.address, prev.size + block.size, prev.prev
            if block.prev is not None:
                block.prev.next = block
        if nxt is not None and not nxt.allocated:
            self._remove_free(pool, nxt)
            block.size, block.next = block.size + nxt.size, nxt.next
            if block.next is not None:
                block.next.prev = block
            else:
                block.segment.last = block
        bisect.insort(pool.free, (block.size, block.address, block))

    def empty_cache(self) -> None:
        """Release every wholly free segment, or an expandable segment's free pages at its end
        (torch.cuda.empty_cache: release_cached_blocks)."""
        for pool in (self._small, self._large):
            self._release_blocks(pool)

    def reset_peak(self) -> None:
        """Set the peaks to the current figures (torch.cuda.reset_peak_memory_stats)."""
        self.peak_reserved_bytes, self.peak_allocated_bytes = self.reserved_bytes, self.allocated_bytes

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        # get_free_block: best fit, the smallest free block >= size, ties to the lowest address.
        free = pool.free
        i = bisect.bisect_left(free, (size, -1))
        if i == len(free):
            return None
        if self.config.expandable_segments and free[i][2].next is None and i + 1 < len(free):
            i += 1  # the free tail's "expandable size" counts the unmapped range after it: any bigger block wins
        block_size, max_split = free[i][0], self.config.max_split_size
        if max_split is not None and size < max_split <= block_size:
            return None  # an oversize block never serves a request below max_split_size
        if max_split is not None and size >= max_split and block_size >= size + LARGE_BUFFER:
            return None  # nor one that would leave 20 MiB (kLargeBuffer) or more of it unused
        return free.pop(i)[2]

    def _should_split(self, pool: _Pool, block: _Block, size: int) -> bool:
        # should_split: a large-pool remainder must exceed 1 MiB, and oversize requests never split.
        remaining = block.size - size
        if pool.small or self.config.expandable_segments:
            return remaining >= MIN_BLOCK_SIZE
        max_split = self.config.max_split_size
        return (max_split is None or size < max_split) and remaining > SMALL_SIZE

    def _split(self, pool: _Pool, block: _Block, size: int) -> None:
        # alloc_found_block: the request takes the block's start; the rest stays free in the same segment.
        rest = _Block(block.address + size, block.size - size, block.segment, prev=block, next=block.next)
        if block.next is not None:
            block.next.prev = rest
        else:
            block.segment.last = rest
        block.next, block.size = rest, size
        bisect.insort(pool.free, (rest.size, rest.address, rest))

    def _new_bytes(self, pool: _Pool, size: int) -> int:
        """Bytes a new segment (alloc_block), or the pages newly mapped (try_allocate_expandable_block), take."""
        if not self.config.expandable_segments:
            return allocation_size(size)
        tail = pool.expandable.last if pool.expandable else None
        free_tail = tail.size if tail is not None and not tail.allocated else 0  # extended, not replaced
        return pool.page * -(-max(0, size - free_tail) // pool.page)

    def _alloc_block(self, pool: _Pool, size: int) -> _Block | None:
        # malloc: alloc_block; past capacity, release_cached_blocks and alloc_block once more; else None.
        capacity, new_bytes = self.config.capacity_bytes, self._new_bytes(pool, size)
        if capacity is not None and self.reserved_bytes + new_bytes > capacity:
            self.empty_cache()
            new_bytes = self._new_bytes(pool, size)  # unmapping may have shrunk a free tail
            if self.reserved_bytes + new_bytes > capacity:
                return None
        self.reserved_bytes += new_bytes
        if not self.config.expandable_segments:  # cudaMalloc a segment that is one free block
            segment = _Segment(self._next_address, new_bytes, pool)
            self._next_address += new_bytes
            self._segments[segment.address] = segment
            segment.last = _Block(segment.address, new_bytes, segment, prev=None, next=None)
            return segment.last
        if pool.expandable is None:
            pool.expandable = _Segment(self._next_address, 0, pool)
            self._next_address += _EXPANDABLE_SPAN
        segment = pool.expandable
        tail = segment.last
        if tail is not None and not tail.allocated:  # map_block merges the new pages into the free tail
            self._remove_free(pool, tail)
            tail.size += new_bytes
        else:
            tail = _Block(segment.address + segment.size, new_bytes, segment, prev=tail, next=None)
            if tail.prev is not None:
                tail.prev.next = tail
            segment.last = tail
        segment.size += new_bytes
        return tail

    def _release_blocks(self, pool: _Pool) -> None:
        # release_blocks: cudaFree each free block that is a whole segment; for an expandable segment,
        # unmap_block's whole free pages, here only those of the free tail (pages inside are kept).
        if not self.config.expandable_segments:
            kept = []
            for entry in pool.free:
                block = entry[2]
                if block.prev is None and block.next is None:
                    del self._segments[block.segment.address]
                    self.reserved_bytes -= block.size
                else:
                    kept.append(entry)
            pool.free = kept
            return
        segment = pool.expandable
        tail = segment.last if segment is not None else None
        if segment is None or tail is None or tail.allocated:
            return
        mapped_end = pool.page * -(-(tail.address - segment.address) // pool.page)  # first whole page in the tail
        unmapped = segment.size - mapped_end
        if unmapped == 0:
            return
        self._remove_free(pool, tail)
        segment.size, tail.size = mapped_end, tail.size - unmapped
        self.reserved_bytes -= unmapped
        if tail.size:
            bisect.insort(pool.free, (tail.size, tail.address, tail))
        else:
            segment.last = tail.prev
            if tail.prev is not None:
                tail.prev.next = None

    @staticmethod
    def _remove_free(pool: _Pool, block: _Block) -> None:
        i = bisect.bisect_left(pool.free, (block.size, block.address))
        assert pool.free[i][2] is block, "a free block missing from its pool"
        del pool.free[i]


@dataclass(frozen=True, kw_only=True)
class ReplayResult:
    """What a replay saw. `phase_peaks`: name -> (peak reserved, peak allocated) bytes while that phase was
    current, the max over its occurrences; `out_of_memory`: what stopped the replay, if anything did."""

    config: AllocatorConfig
    phase_peaks: Mapping[str, tuple[int, int]]
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    final_reserved_bytes: int
    out_of_memory: OutOfMemory | None = None

    @property
    def ran_out_of_memory(self) -> bool:
        return self.out_of_memory is not None


def replay(events: Iterable[tuple], config: AllocatorConfig | None = None) -> ReplayResult:
    """Replay ("alloc", key, nbytes), ("free", key), ("phase", name) and ("empty_cache",) events on a
    fresh allocator. A phase mark resets the peaks (reset_peak_memory_stats), so each phase's peaks are its
    own. An OutOfMemory stops the replay and is returned in the result; a bad event raises ValueError."""
    allocator = CachingAllocator(config)
    windows: list[tuple[str | None, int, int]] = []  # (phase, peak reserved, peak allocated) per stretch
    phase: str | None = None
    out_of_memory = None
    try:
        for event in events:
            match event:
                case ("alloc", key, int(nbytes)):
                    allocator.malloc(key, nbytes)
                case ("free", key):
                    allocator.free(key)
                case ("phase", str(name)):
                    windows.append((phase, allocator.peak_reserved_bytes, allocator.peak_allocated_bytes))
                    phase = name
                    allocator.reset_peak()
                case ("empty_cache",):
                    allocator.empty_cache()
                case _:
                    raise ValueError(f"not an allocator event: {event!r}")
    except OutOfMemory as error:
        out_of_memory = error
    windows.append((phase, allocator.peak_reserved_bytes, allocator.peak_allocated_bytes))
    phase_peaks: dict[str, tuple[int, int]] = {}
    for name, reserved, allocated in windows:
        if name is not None:
            before = phase_peaks.get(name, (0, 0))
            phase_peaks[name] = (max(before[0], reserved), max(before[1], allocated))
    return ReplayResult(
        config=allocator.config,
        phase_peaks=phase_peaks,
        peak_reserved_bytes=max(w[1] for w in windows),
        peak_allocated_bytes=max(w[2] for w in windows),
        final_reserved_bytes=allocator.reserved_bytes,
        out_of_memory=out_of_memory,
    )
