"""Schedules planned without a table over positions (pure Python, no JAX): the generators of
stores against the table-building rules they replace, and what planning allocates."""

import itertools
import tracemalloc

import numpy as np
import pytest
from selection import slow_unless

from odeckpt.checkpointing.schedules import (
    binomial,
    offline_schedule,
    online_schedule,
    plan,
    repetition_number,
)


def reference_online_store(max_steps: int, c: int) -> np.ndarray:
    """The online schedule's store table built position by position: odeckpt's rules as they
    were written before the generator (fill, Stumm & Walther's rounds, the release rule)."""
    store = np.full(max_steps, -1, dtype=np.int64)
    store[0] = 0
    i = min(c, max_steps)
    store[1:i] = np.arange(1, i)
    _reference_rounds(store, c, i)
    if c >= 2 and max_steps > binomial(c, 2):
        _reference_later_phases(store, c)
    return store


def _reference_rounds(store: np.ndarray, c: int, i: int) -> None:
    limit = min(len(store), binomial(c, 2) - 1)
    for o in range(c - 1, 0, -1):
        i += 1  # this round skips one state
        for j, slot in enumerate([o, *range(1, o)]):
            if i + j >= limit:
                return
            store[i + j] = slot
        i += o


def _reference_later_phases(store: np.ndarray, c: int) -> None:
    held = np.zeros(c, dtype=np.int64)
    for i in range(1, binomial(c, 2) - 1):
        if store[i] >= 0:
            held[store[i]] = i
    slot_of = {int(p): s for s, p in enumerate(held)}
    pos = sorted(slot_of)
    r = 3
    while True:
        targets = itertools.accumulate(binomial(c - j, r - 1) for j in range(c - 1))
        pinned = {0}
        for target in targets:
            while pos[-1] < target:
                d = target - pos[-1]
                q = pos[-1] + (r + 1 if d % r and d > r else min(r, d))
                if q >= len(store):
                    return
                p = pos.pop(_reference_release(pos, pinned, q, c, r))
                store[q] = slot_of[q] = slot_of.pop(p)
                pos.append(q)
            pinned.add(target)
        r += 1


def _reference_release(pos: list[int], pinned: set[int], q: int, c: int, r: int) -> int:
    best, best_over = c - 1, None
    for i in range(c - 1, 0, -1):
        if pos[i] in pinned:
            continue
        merged = (pos[i + 1] if i + 1 < c else q) - pos[i - 1]
        over = merged - binomial(c - i + 1, r - 1)
        if over <= 0:
            return i
        if best_over is None or over < best_over:
            best, best_over = i, over
    return best


@pytest.mark.parametrize("c", range(1, 9))
def test_online_generator_equals_the_table_rules(c):
    """Every position up to 3000 (a schedule's stores do not depend on `max_steps`, which only
    cuts them), and short schedules that end inside the fill or the rounds."""
    assert np.array_equal(online_schedule(3000, c).store, reference_online_store(3000, c))
    for steps in (1, 2, 3, c, c + 2, binomial(c, 2) - 1, binomial(c, 2) + 1):
        if steps >= 1:
            got = online_schedule(steps, c).store
            assert np.array_equal(got, reference_online_store(steps, c)), (c, steps)


@pytest.mark.parametrize("c", slow_unless(range(2, 7), fast={2, 3, 4}))
def test_online_phase_start_replays_to_the_held_positions(c):
    """What the statistics do at run time: from the start of the phase of the last store
    before the stop, the generator reaches the positions held at the stop."""
    schedule = online_schedule(1000, c)
    for n in range(binomial(c, 2) + 1, 1001):
        r = max(3, 2 + sum(binomial(c, j) <= n - 2 for j in range(2, schedule.repetitions + 3)))
        state = schedule.phase_start(r)
        while state.position <= n - 2:
            state = schedule.advance(state)
        assert tuple(int(p) for p in state.held) == schedule.positions(n), (c, n)


@pytest.mark.parametrize("c", range(2, 8))
def test_online_segments_stay_within_the_tables_repetition_number(c):
    """`Schedule.binomials` resolves repetition numbers up to `repetitions + 1`: every segment
    the reverse sweep reverses at any stop (with its free slots; Revolve's recursion inside it
    never exceeds its repetition number) stays within `repetitions`."""
    steps = 1500
    schedule = online_schedule(steps, c)
    for n in range(2, steps + 1):
        positions = schedule.positions(n)
        ends = [*positions[1:], n - 1]
        for j, (p, e) in enumerate(zip(positions, ends, strict=True)):
            if e - p >= 2 and c - j >= 2:
                assert repetition_number(e - p, c - j) <= schedule.repetitions, (c, n, j)


def test_offline_generator_stores_revolves_positions():
    for c, n in ((1, 5), (3, 10), (4, 100), (12, 50), (60, 40)):
        schedule = offline_schedule(n, c)
        stores = [(int(p), int(k)) for k, p in enumerate(schedule.stored)]
        assert [(p, int(schedule.store[p])) for p in schedule.positions()] == stores


@pytest.mark.parametrize("max_steps", [10**6, 10**9])
@pytest.mark.parametrize("c", [2, 16, None])  # None: a while loop's default
def test_planning_allocates_nothing_per_position(max_steps, c):
    """Planning a while loop of `max_steps` steps (the plan, the schedule, its first stores and
    its table of binomials) allocates `O(c r)` integers, not `O(max_steps)`."""
    tracemalloc.start()
    the_plan = plan(max_steps, 64, checkpoints=c, online=True)
    c = the_plan.checkpoints
    schedule = online_schedule(max_steps, c)
    state = schedule.start()
    for _ in range(100):
        state = schedule.advance(state)
    table = schedule.binomials
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert table.shape == (c + 2, schedule.repetitions + 3)
    assert schedule.repetitions == repetition_number(max_steps, c)
    assert peak < 4 * table.nbytes + 2**18, (peak, table.nbytes)
    assert state.position < max_steps


def test_steps_beyond_int32_positions_raise_naming_the_fix():
    with pytest.raises(ValueError, match="lower max_steps"):
        online_schedule(2**30, 4)
