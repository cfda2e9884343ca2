"""The caching-allocator replay: hand-built event streams whose reserved bytes follow from
CUDACachingAllocator.cpp's rules, the arithmetic beside each."""

import random

import pytest

from trainplan.errors import ConfigError
from trainplan.plan.allocator import (
    AllocatorConfig,
    CachingAllocator,
    OutOfMemory,
    SegmentInfo,
    allocation_size,
    replay,
    round_size,
)

KiB, MiB = 1 << 10, 1 << 20
EXPANDABLE = AllocatorConfig(expandable_segments=True)


def allocate(config=None, *sizes):
    """An allocator holding one live block per size, keyed 0, 1, ..."""
    allocator = CachingAllocator(config)
    for key, nbytes in enumerate(sizes):
        allocator.malloc(key, nbytes)
    return allocator


def test_rounding_and_segment_sizes():
    assert [round_size(n) for n in (1, 511, 512, 513, MiB + 1)] == [512, 512, 512, 1024, MiB + 512]
    # <= 1 MiB: a 2 MiB segment; under 10 MiB: 20 MiB; from 10 MiB: its own size rounded up to 2 MiB
    assert [allocation_size(n) for n in (512, MiB, MiB + 512, 10 * MiB - 512)] == [2 * MiB, 2 * MiB, 20 * MiB, 20 * MiB]
    assert [allocation_size(n) for n in (10 * MiB, 11 * MiB, 12 * MiB)] == [10 * MiB, 12 * MiB, 12 * MiB]


@pytest.mark.parametrize(
    "nbytes, allocated, segments",
    [
        (1, 512, [SegmentInfo(2 * MiB, 512)]),  # 1 byte rounds to 512, small pool: a 2 MiB segment
        (MiB, MiB, [SegmentInfo(2 * MiB, MiB)]),  # exactly 1 MiB is still small
        (MiB + 1, MiB + 512, [SegmentInfo(20 * MiB, MiB + 512)]),  # 1 MiB + 512 is large: a 20 MiB segment
        (10 * MiB, 10 * MiB, [SegmentInfo(10 * MiB, 10 * MiB)]),  # from 10 MiB: a segment of its own size
        (11 * MiB, 12 * MiB, [SegmentInfo(12 * MiB, 12 * MiB)]),  # 12 MiB; 1 MiB left is not > 1 MiB: unsplit
        (10 * MiB + 1, 10 * MiB + 512, [SegmentInfo(12 * MiB, 10 * MiB + 512)]),  # 2 MiB - 512 left: split
    ],
)
def test_one_request(nbytes, allocated, segments):
    allocator = allocate(None, nbytes)
    assert allocator.allocated_bytes == allocated and allocator.segments == segments
    assert allocator.reserved_bytes == allocator.peak_reserved_bytes == sum(s.size for s in segments)


def test_an_empty_request_takes_nothing_and_frees_cleanly():
    allocator = allocate(None, 0)
    assert allocator.reserved_bytes == allocator.allocated_bytes == 0 and allocator.segments == []
    allocator.free(0)
    with pytest.raises(ValueError, match="not live"):
        allocator.free(0)


def test_small_requests_share_a_2_mib_segment():
    # 4 x 512 KiB = 2 MiB: each split leaves >= 512 bytes, the fourth takes the last 512 KiB exactly
    allocator = allocate(None, *[512 * KiB] * 4)
    assert allocator.segments == [SegmentInfo(2 * MiB, 2 * MiB)]
    allocator.malloc("fifth", 512 * KiB)  # nothing free in the small pool: a second 2 MiB segment
    assert allocator.segments == [SegmentInfo(2 * MiB, 2 * MiB), SegmentInfo(2 * MiB, 512 * KiB)]
    assert allocator.reserved_bytes == 4 * MiB


def test_the_pools_never_share_blocks():
    # a 20 MiB large segment with 15 MiB free does not serve a 512 KiB (small) request: a 2 MiB segment does
    allocator = allocate(None, 5 * MiB, 512 * KiB)
    assert allocator.segments == [SegmentInfo(20 * MiB, 5 * MiB), SegmentInfo(2 * MiB, 512 * KiB)]


def test_two_mid_size_requests_share_a_20_mib_segment():
    # 5 MiB in 20 MiB leaves 15 MiB (> 1 MiB: split); the next 5 MiB takes that, leaving 10 MiB
    allocator = allocate(None, 5 * MiB, 5 * MiB)
    assert allocator.segments == [SegmentInfo(20 * MiB, 10 * MiB)]


@pytest.mark.parametrize(
    "first, allocated, reserved",
    [
        # 19 MiB -> a 20 MiB segment (2 MiB rounding); remaining 1 MiB is not > 1 MiB: unsplit, all 20 MiB
        # allocated, so a 1.5 MiB request needs a new 20 MiB segment: 40 MiB reserved
        (19 * MiB, 20 * MiB + 1536 * KiB, 40 * MiB),
        # 18.5 MiB -> a 20 MiB segment; remaining 1.5 MiB > 1 MiB: split, and the 1.5 MiB request fits there
        (18 * MiB + 512 * KiB, 20 * MiB, 20 * MiB),
    ],
)
def test_a_large_block_splits_only_above_1_mib_left(first, allocated, reserved):
    allocator = allocate(None, first, 1536 * KiB)
    assert (allocator.allocated_bytes, allocator.reserved_bytes) == (allocated, reserved)


def test_a_block_taken_whole_counts_whole():
    # 9 MiB opens a 20 MiB segment (split: 11 MiB left); freed, the segment is one 20 MiB block again.
    # 19.5 MiB takes it (best fit), leaving 0.5 MiB, not > 1 MiB: unsplit, so 20 MiB allocated
    allocator = allocate(None, 9 * MiB)
    allocator.free(0)
    allocator.malloc(1, 19 * MiB + 512 * KiB)
    assert allocator.segments == [SegmentInfo(20 * MiB, 20 * MiB)]


@pytest.mark.parametrize(
    "config, first, then, reserved",
    [
        # 8 x 16 MiB: eight 16 MiB segments (128 MiB); freed, none fits 32 MiB: four more 32 MiB segments
        (None, [16 * MiB] * 8, [32 * MiB] * 4, 256 * MiB),
        # 4 x 32 MiB: four 32 MiB segments; each splits into two 16 MiB blocks (16 MiB left > 1 MiB): 128 MiB
        (None, [32 * MiB] * 4, [16 * MiB] * 8, 128 * MiB),
        # expandable, 20 MiB pages: 8 x 16 MiB maps pages as the free tail runs short:
        # 20 (tail 4), +20 (tail 8), +20 (12), +20 (16), the fifth fits the 16 MiB tail, +20 (4), +20 (8),
        # +20 (12) = 140 MiB; freed, one 140 MiB block serves 4 x 32 MiB
        (EXPANDABLE, [16 * MiB] * 8, [32 * MiB] * 4, 140 * MiB),
        # 4 x 32 MiB: 40 (tail 8), +40 (tail 16), +20 (tail 4), +40 (tail 12) = 140 MiB; 8 x 16 MiB fit in it
        (EXPANDABLE, [32 * MiB] * 4, [16 * MiB] * 8, 140 * MiB),
    ],
)
def test_the_order_of_sizes_decides_the_reserve(config, first, then, reserved):
    events = [("alloc", ("a", i), n) for i, n in enumerate(first)] + [("free", ("a", i)) for i in range(len(first))]
    events += [("alloc", ("b", i), n) for i, n in enumerate(then)]
    result = replay(events, config)
    assert result.final_reserved_bytes == result.peak_reserved_bytes == reserved
    assert result.peak_allocated_bytes == 128 * MiB and not result.ran_out_of_memory


def test_best_fit_takes_the_smallest_block_that_fits():
    # three freed segments of 12, 16 and 14 MiB (>= 10 MiB: own size)
    allocator = allocate(None, 12 * MiB, 16 * MiB, 14 * MiB)
    for key in range(3):
        allocator.free(key)
    allocator.malloc("a", 13 * MiB)  # 14 MiB fits best (12 is too small); 1 MiB left is not split
    assert allocator.segments == [SegmentInfo(12 * MiB, 0), SegmentInfo(16 * MiB, 0), SegmentInfo(14 * MiB, 14 * MiB)]
    allocator.malloc("b", 15 * MiB)  # then the 16 MiB block, then the 12 MiB one: still 42 MiB reserved
    allocator.malloc("c", 12 * MiB)
    assert allocator.reserved_bytes == 42 * MiB and allocator.allocated_bytes == 42 * MiB


def test_best_fit_ties_go_to_the_lowest_address():
    allocator = allocate(None, 16 * MiB, 16 * MiB)  # two 16 MiB segments, the first at the lower address
    allocator.free(1)
    allocator.free(0)
    allocator.malloc("again", 16 * MiB)
    assert allocator.segments == [SegmentInfo(16 * MiB, 16 * MiB), SegmentInfo(16 * MiB, 0)]


def test_freed_neighbours_merge_within_a_segment():
    # 4 x 5 MiB fill one 20 MiB segment: [a b c d]; freeing b then c leaves one 10 MiB free block
    allocator = allocate(None, *[5 * MiB] * 4)
    allocator.free(1)
    allocator.free(2)
    allocator.malloc("ten", 10 * MiB)  # fits the merged block exactly: no 10 MiB segment
    assert allocator.segments == [SegmentInfo(20 * MiB, 20 * MiB)]
    for key in (0, 3, "ten"):  # the whole segment merges back into one free block, reused for 20 MiB
        allocator.free(key)
    allocator.malloc("twenty", 20 * MiB)
    assert allocator.segments == [SegmentInfo(20 * MiB, 20 * MiB)]


def test_blocks_of_different_segments_never_merge():
    # two 16 MiB segments, both free: 32 MiB of free cache, but 32 MiB needs a segment of its own
    allocator = allocate(None, 16 * MiB, 16 * MiB)
    allocator.free(0)
    allocator.free(1)
    allocator.malloc("big", 32 * MiB)
    assert allocator.reserved_bytes == 64 * MiB and len(allocator.segments) == 3


@pytest.mark.parametrize(
    "max_split_size, reserved",
    [
        (None, 40 * MiB),  # unlimited: the cached 40 MiB block splits for 4 MiB (36 MiB left)
        (32 * MiB, 60 * MiB),  # 40 MiB >= 32 MiB is oversize: 4 MiB opens a 20 MiB segment instead
    ],
)
def test_an_oversize_block_is_not_split_for_a_small_request(max_split_size, reserved):
    allocator = allocate(AllocatorConfig(max_split_size=max_split_size), 40 * MiB)
    allocator.free(0)
    allocator.malloc(1, 4 * MiB)
    assert allocator.reserved_bytes == reserved


def test_an_oversize_block_serves_a_request_within_20_mib_of_it():
    allocator = allocate(AllocatorConfig(max_split_size=32 * MiB), 64 * MiB)
    allocator.free(0)
    allocator.malloc("far", 44 * MiB)  # 64 >= 44 + 20: refused, a 44 MiB segment opens (108 MiB)
    allocator.malloc("near", 50 * MiB)  # 64 < 50 + 20: taken, and unsplit (50 MiB >= max_split_size)
    assert allocator.segments == [SegmentInfo(64 * MiB, 64 * MiB), SegmentInfo(44 * MiB, 44 * MiB)]


def test_past_capacity_the_cache_is_released_before_out_of_memory():
    allocator = allocate(AllocatorConfig(capacity_bytes=64 * MiB), 40 * MiB)
    allocator.free(0)
    # 48 MiB: no cached fit; 40 + 48 = 88 MiB > 64 MiB, so the free 40 MiB segment goes first: 48 MiB
    allocator.malloc(1, 48 * MiB)
    assert allocator.segments == [SegmentInfo(48 * MiB, 48 * MiB)] and allocator.peak_reserved_bytes == 48 * MiB
    # 32 MiB: 48 + 32 = 80 MiB > 64 MiB and nothing is wholly free: out of memory, state unchanged
    with pytest.raises(OutOfMemory) as raised:
        allocator.malloc(2, 32 * MiB)
    assert (raised.value.requested, raised.value.reserved, raised.value.capacity) == (32 * MiB, 48 * MiB, 64 * MiB)
    assert allocator.allocated_bytes == 48 * MiB
    allocator.malloc(3, 16 * MiB)  # 48 + 16 = 64 MiB fits exactly
    assert allocator.reserved_bytes == 64 * MiB


def test_replay_stops_at_out_of_memory_and_says_so():
    events = [("phase", "step"), ("alloc", "a", 48 * MiB), ("alloc", "b", 32 * MiB), ("alloc", "c", 1)]
    result = replay(events, AllocatorConfig(capacity_bytes=64 * MiB))
    assert result.ran_out_of_memory and result.out_of_memory.requested == 32 * MiB
    assert result.phase_peaks == {"step": (48 * MiB, 48 * MiB)} and result.final_reserved_bytes == 48 * MiB


def test_expandable_pages_extend_the_free_tail_and_empty_cache_unmaps_it():
    # 16 MiB maps one 20 MiB page (tail 4 free); 16 more needs 12: one page more, 40 MiB, tail 8 free
    allocator = allocate(EXPANDABLE, 16 * MiB, 16 * MiB)
    assert allocator.segments == [SegmentInfo(40 * MiB, 32 * MiB)]
    # freed, the second merges with the tail: 16..40 MiB free; whole pages from 20 MiB unmap, 16..20 stays
    allocator.free(1)
    allocator.empty_cache()
    assert allocator.segments == [SegmentInfo(20 * MiB, 16 * MiB)]
    allocator.malloc(2, 16 * MiB)  # the 4 MiB tail plus one page: 40 MiB again
    allocator.malloc(3, MiB)  # small pool: its own segment of 2 MiB pages
    assert allocator.segments == [SegmentInfo(40 * MiB, 32 * MiB), SegmentInfo(2 * MiB, MiB)]
    for key in (0, 2, 3):
        allocator.free(key)
    allocator.empty_cache()
    assert allocator.reserved_bytes == 0 and allocator.segments == []


def test_expandable_best_fit_prefers_a_mapped_block_to_the_free_tail():
    # [a 16][b 16][c 16][tail 12 free] in 60 MiB; freeing b leaves free blocks of 16 (b) and 12 (tail).
    # 10 MiB: the tail is the best fit by size, but its unmapped range counts, so b is taken and split (6 left)
    allocator = allocate(EXPANDABLE, 16 * MiB, 16 * MiB, 16 * MiB)
    allocator.free(1)
    allocator.malloc("x", 10 * MiB)
    # 14 MiB fits neither b's 6 MiB nor the 12 MiB tail: the tail grows by a page, 80 MiB
    # (had 10 MiB taken the tail, b's 16 MiB would have served 14 MiB within 60 MiB)
    allocator.malloc("y", 14 * MiB)
    assert allocator.segments == [SegmentInfo(80 * MiB, 56 * MiB)]


def test_phases_keep_their_own_peaks():
    events = [
        ("alloc", "early", 1),  # before any phase: 2 MiB reserved, 512 allocated
        ("free", "early"),
        ("phase", "forward"),  # peaks reset to (2 MiB, 0)
        ("alloc", "a", 8 * MiB),  # a 20 MiB segment, 12 MiB left (split)
        ("alloc", "b", 8 * MiB),  # from the 12 MiB, 4 left: (22 MiB, 16 MiB)
        ("phase", "backward"),
        ("free", "a"),
        ("alloc", "c", 12 * MiB),  # 8 and 4 MiB free, none fits 12: a 12 MiB segment, (34 MiB, 20 MiB)
        ("free", "b"),
        ("free", "c"),
        ("phase", "forward"),  # again, peaks reset to (34 MiB, 0); the phase keeps the max of both times
        ("alloc", "d", 10 * MiB),  # best fit: the free 12 MiB segment (not the merged 20), split: (34 MiB, 10 MiB)
        ("empty_cache",),  # releases the free 20 MiB and 2 MiB segments; the split 12 MiB one stays
    ]
    result = replay(events)
    assert result.phase_peaks == {"forward": (34 * MiB, 16 * MiB), "backward": (34 * MiB, 20 * MiB)}
    assert (result.peak_reserved_bytes, result.peak_allocated_bytes) == (34 * MiB, 20 * MiB)
    assert result.final_reserved_bytes == 12 * MiB and result.config == AllocatorConfig()


def test_reset_peak_sets_the_peaks_to_now():
    allocator = allocate(None, 16 * MiB, 16 * MiB)
    allocator.free(0)
    allocator.reset_peak()
    assert (allocator.peak_reserved_bytes, allocator.peak_allocated_bytes) == (32 * MiB, 16 * MiB)


@pytest.mark.parametrize(
    "events, match",
    [
        ([("free", "a")], "not live"),
        ([("alloc", "a", 8), ("alloc", "a", 8)], "already live"),
        ([("alloc", "a", -1)], "negative"),
        ([("malloc", "a", 8)], "not an allocator event"),
        ([("phase",)], "not an allocator event"),
    ],
)
def test_a_bad_event_is_refused(events, match):
    with pytest.raises(ValueError, match=match):
        replay(events)


@pytest.mark.parametrize("field, value", [("max_split_size", 16 * MiB), ("capacity_bytes", 0)])
def test_a_bad_config_names_its_field(field, value):
    with pytest.raises(ConfigError, match=field):
        AllocatorConfig(**{field: value})


@pytest.mark.parametrize("config", [AllocatorConfig(), EXPANDABLE, AllocatorConfig(max_split_size=64 * MiB)])
def test_a_long_random_stream_keeps_the_books(config):
    rng = random.Random(0)
    allocator, live = CachingAllocator(config), []
    for step in range(100_000):
        if live and (rng.random() < 0.45 or len(live) > 2000):
            allocator.free(live.pop(rng.randrange(len(live))))
        else:
            nbytes = rng.choice((rng.randint(1, 2 * MiB), rng.randint(1, 100 * MiB)))
            allocator.malloc(step, nbytes)
            live.append(step)
        if step % 5000 == 0:
            segments = allocator.segments
            assert allocator.allocated_bytes <= allocator.reserved_bytes == sum(s.size for s in segments)
            assert allocator.allocated_bytes == sum(s.allocated_bytes for s in segments)
    for key in live:
        allocator.free(key)
    assert allocator.allocated_bytes == 0 and allocator.peak_reserved_bytes >= allocator.reserved_bytes > 0
    allocator.empty_cache()  # everything is free: every segment (every page) goes back
    assert allocator.reserved_bytes == 0 and allocator.segments == []
