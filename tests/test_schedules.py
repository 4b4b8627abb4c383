"""Pure-Python tests of the schedules: no JAX needed (conftest imports it, the code does not)."""

import functools
import itertools
import subprocess
import sys

import pytest

from odeckpt.checkpointing.schedules import (
    DEFAULT_MEMORY_BUDGET,
    binomial,
    binomial_table,
    offline_schedule,
    online_schedule,
    optimal_cost,
    parse_memory,
    plan,
    repetition_number,
    simulate,
    split,
)


@functools.cache
def brute_force(length: int, slots: int) -> int:
    """Griewank's dynamic programme over every first advance `m` (no closed form used)."""
    if length <= 1:
        return 0
    if slots == 1:
        return length * (length - 1) // 2
    return min(
        m + brute_force(length - m, slots - 1) + brute_force(m, slots) for m in range(1, length)
    )


def closed_form(n: int, c: int) -> int:
    r = 0
    while binomial(c, r) < n:
        r += 1
    return r * n - binomial(c + 1, r - 1)


def test_offline_hits_closed_form_for_all_n_le_300_c_le_12():
    for c in range(1, 13):
        for n in range(1, 301):
            sim = simulate(offline_schedule(n, c), n)
            assert sim.forward_steps == closed_form(n, c) == optimal_cost(n, c), (n, c)
            assert sim.reversal_order == tuple(range(n - 1, -1, -1))
            assert sim.peak_snapshots <= c
            assert sim.step_evaluations == sim.forward_steps + 1 + n


def test_closed_form_equals_brute_force_dynamic_programme():
    for c in range(1, 7):
        for n in range(1, 61):
            assert optimal_cost(n, c) == brute_force(n, c), (n, c)


def test_split_is_an_optimal_first_advance():
    for s in range(2, 7):
        for length in range(2, 80):
            m = split(length, s)
            assert 1 <= m < length
            cost = m + brute_force(length - m, s - 1) + brute_force(m, s)
            assert cost == brute_force(length, s), (length, s, m)


def test_binomial_table_reproduces_split():
    c, n = 6, 500
    table = binomial_table(c, n)
    for s in range(2, c + 1):
        for length in range(2, n + 1):
            r = int((table[s] < length).sum())
            m = min(table[s, r - 1], length - table[s - 1, r - 1])
            assert m == split(length, s)
            assert r == repetition_number(length, s)


def test_hand_written_reversal_order():
    # n = 5, c = 2: split(5, 2) = 3, so the first sweep stores 0 and 3 and keeps 4 in hand.
    sim = simulate(offline_schedule(5, 2), 5, record=True)
    assert sim.actions == (
        ("reverse", 4),
        ("restore", 3),
        ("reverse", 3),
        ("restore", 0),
        ("advance", 0),
        ("store", 1),
        ("advance", 1),
        ("reverse", 2),
        ("restore", 1),
        ("reverse", 1),
        ("restore", 0),
        ("reverse", 0),
    )
    assert sim.forward_steps == optimal_cost(5, 2) == 6


@pytest.mark.parametrize("c", range(1, 13))
def test_online_is_optimal_up_to_repetition_two(c):
    steps = binomial(c, 2)  # C(c+2, 2)
    schedule = online_schedule(steps, c)
    for n in range(1, steps + 1):
        sim = simulate(schedule, n)
        assert sim.forward_steps == optimal_cost(n, c), (n, c)
        assert sim.peak_snapshots <= c


@pytest.mark.parametrize("c", range(1, 13))
def test_online_stays_within_one_repetition_beyond(c):
    """Past C(c+2, 2) (up to C(c+3, 3) and at least 300): at most one extra repetition."""
    steps = max(binomial(c, 3), 300)
    schedule = online_schedule(steps, c)
    for n in range(binomial(c, 2) + 1, steps + 1):
        sim = simulate(schedule, n)
        assert optimal_cost(n, c) <= sim.forward_steps <= optimal_cost(n, c) + n, (n, c)
        assert sim.reversal_order == tuple(range(n - 1, -1, -1))


def test_online_optimal_at_every_step_is_impossible_beyond_repetition_two():
    """Why the online bound past C(c+2, 2) is not the offline optimum (c = 2, n = 7..10).

    With two slots, slot 0 holds position 0 and the other holds one position p < n - 1, which
    can only be replaced by the newest position. Exhaustively: no p is optimal for all n.
    """
    c = 2

    def cost(n, p):
        return (n - 1) + brute_force(p, 2) + brute_force(n - 1 - p, 1)

    optimal = {
        n: [p for p in range(1, n - 1) if cost(n, p) == optimal_cost(n, c)] for n in (7, 8, 9, 10)
    }
    assert optimal == {7: [3, 4], 8: [4, 5], 9: [5, 6], 10: [6]}
    # p can only move to the newest position (n - 2 when deciding for stop n), never to an
    # older one: no chain of choices stays optimal through n = 7..10.
    for chain in itertools.product(*optimal.values()):
        moves = list(zip((7, 8, 9, 10), chain, strict=True))
        assert any(
            p2 != p1 and p2 != n2 - 2 for (_, p1), (n2, p2) in zip(moves, moves[1:], strict=False)
        )


def test_stumm_walther_worked_example_c3():
    """The first algorithm with three slots, stop by stop (derived by hand from the rule).

    Fill 0, 1, 2; round o=2 skips 3, stores 4 (slot 2) and 5 (slot 1); round o=1 skips 6,
    stores 7 (slot 1). At n = C(5, 2) = 10 the segments are 4, 3, 2 = c+1, c, c-1.
    """
    schedule = online_schedule(10, 3)
    expected = {
        1: (0,),
        2: (0,),
        3: (0, 1),
        4: (0, 1, 2),
        5: (0, 1, 2),
        6: (0, 1, 4),
        7: (0, 4, 5),
        8: (0, 4, 5),
        9: (0, 4, 7),
        10: (0, 4, 7),
    }
    for n, positions in expected.items():
        assert schedule.positions(n) == positions, n
        assert simulate(schedule, n).forward_steps == optimal_cost(n, 3)


def test_importing_schedules_does_not_import_jax():
    code = (
        "import sys\n"
        "import odeckpt.checkpointing.schedules as s\n"
        "s.simulate(s.online_schedule(50, 3), 40)\n"
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_parse_memory():
    assert parse_memory("2GB") == 2 * 10**9
    assert parse_memory("512MiB") == 512 * 2**20
    assert parse_memory("1.5 GiB") == 3 * 2**29
    assert parse_memory(100) == 100
    for bad in ["2 parsecs", "", "-1GB"]:
        with pytest.raises(ValueError, match="memory_budget"):
            parse_memory(bad)
    with pytest.raises(TypeError):
        parse_memory(1.5)  # type: ignore[arg-type]


def test_plan_regimes():
    small = plan(1000, snapshot_bytes=32, residual_bytes=200)
    assert small.regime == "residuals" and small.forward_steps == 1000
    states = plan(1000, snapshot_bytes=1000, residual_bytes=10**6, memory_budget="1MB")
    assert states.regime == "states" and states.checkpoints == 1000
    binom = plan(1000, snapshot_bytes=10**4, memory_budget="100kB")
    assert binom.regime == "binomial" and binom.checkpoints == 10
    assert binom.forward_steps == optimal_cost(1000, 10)
    assert plan(10, 8, checkpoints=50).regime == "states"
    big = plan(10**4, snapshot_bytes=DEFAULT_MEMORY_BUDGET)
    assert big.regime == "binomial" and big.checkpoints >= 4
    assert "binomial" in str(binom)


def test_plan_errors_name_the_fix():
    with pytest.raises(ValueError, match="checkpoints=1"):
        plan(10, 8, checkpoints=0)
    with pytest.raises(ValueError, match="max_steps must be >= 1"):
        plan(0, 8)
    with pytest.raises(ValueError, match="at least 800 bytes"):
        plan(10, 800, memory_budget=100)
    with pytest.raises(ValueError, match="not both"):
        plan(10, 8, checkpoints=2, memory_budget="1GB")
    with pytest.raises(ValueError, match="checkpoints must be >= 1"):
        offline_schedule(10, 0)
