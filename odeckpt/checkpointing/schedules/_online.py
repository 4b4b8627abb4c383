"""Online checkpointing: the number of steps is unknown until the loop stops (`<= max_steps`).

References:

- P. Stumm and A. Walther (2010), "New algorithms for optimal online checkpointing",
  SIAM J. Sci. Comput. 32(2), 836-854.
- A. Griewank and A. Walther (2000), "Algorithm 799: Revolve", ACM TOMS 26(1) (the repetition
  numbers and the binomial bounds `beta(s, r)` used below).
- Q. Wang, P. Moin and G. Iaccarino (2009), "Minimal repetition dynamic checkpointing algorithm
  for unsteady adjoint calculation", SIAM J. Sci. Comput. 31(4), 2549-2567 (dynamic
  checkpointing, the online rule `docs/checkpointing.md` compares ours with).
"""

import dataclasses
import functools
from typing import Any, ClassVar, NamedTuple

import numpy as np

from ._binomial import binomial, check_counts
from ._schedule import NUMPY, Ops, Schedule


class OnlineStore(NamedTuple):
    """The next store of an online schedule, and what the one after it depends on.

    - `position`, `slot`: the store (`position >= steps`: none).
    - `round`, `index`: in phases 1-2, the round `o` (`c` while filling) and the store's index
        in it.
    - `phase`: the repetition number `r`, `2` until the rounds end.
    - In phases `r >= 3` (all `None` in a schedule that never reaches them): `release`, the
        index in `held` of the snapshot the store releases; `target` and `target_index`, the
        next target `P_k` and `k`; `held`, `slots`, `pinned`, the positions held before the
        store (sorted), their slots, and which of them are pinned.
    """

    position: Any
    slot: Any
    round: Any
    index: Any
    phase: Any
    release: Any
    target: Any
    target_index: Any
    held: Any
    slots: Any
    pinned: Any


@dataclasses.dataclass(frozen=True, eq=False)
class OnlineSchedule(Schedule):
    """The stores of `online_schedule`, generated phase by phase.

    Phases 1-2 are Stumm & Walther's fill and rounds. Phase `r >= 3` starts at
    `n = beta(c, r-1)` with the segments between the sorted snapshots `p_0 < ... < p_{c-1}` at
    the upper ends `beta(c-j, r-2)` of their optimal ranges for `r - 1`, which are the lower
    ends for `r` (segment `j` is reversed with `c - j` slots; the open segment from `p_{c-1}`
    to the state in hand has one). It ends at `n = beta(c, r)` with them at `beta(c-j, r-1)`.
    The final positions `P_k = sum_{j<k} beta(c-j, r-1)` are the targets: the newest state is
    stored every `r` steps (`r + 1` while the distance to the next target is not a multiple of
    `r`, so that each target is hit exactly), and a stored target is never released. Each
    store releases the snapshot `_release_rule` picks. See `docs/checkpointing.md` for the
    measured excess over `t(n, c)`.
    """

    online: ClassVar[bool] = True

    @property
    def later_phases(self) -> bool:
        """Whether the schedule reaches the phases `r >= 3` (beyond `C(c+2, 2)` steps)."""
        return self.checkpoints >= 2 and self.steps > binomial(self.checkpoints, 2)

    def start(self, ops: Ops = NUMPY) -> OnlineStore:
        c = self.checkpoints
        first, zero = ops.int(1 if c >= 2 else self.steps), ops.int(0)
        rule = (None,) * 6
        if self.later_phases:
            held = ops.int(np.zeros(c))
            rule = (zero, zero, zero, held, held, ops.xp.asarray(np.zeros(c, bool)))
        return OnlineStore(first, ops.int(1), ops.int(c), zero, ops.int(2), *rule)

    def advance(self, state: OnlineStore, ops: Ops = NUMPY) -> OnlineStore:
        in_rounds = lambda state: self._in_rounds(state, ops)
        if not self.later_phases:
            return in_rounds(state)
        by_rule = lambda state: self._pending(self._apply(state, ops), ops)
        state = ops.cond(state.phase == 2, in_rounds, by_rule, state)
        # After the last round the rule takes over from the placement the rounds leave.
        third = lambda state: self.phase_start(ops.int(3), ops)
        return ops.cond((state.phase == 2) & (state.round == 0), third, lambda s: s, state)

    def _in_rounds(self, state: OnlineStore, ops: Ops) -> OnlineStore:
        """Phases 1-2: fill slots `1..c-1`, then rounds `o = c-1, ..., 1`, each skipping one
        position and storing `o` (slots `o, 1, ..., o-1`)."""
        xp, c = ops.xp, self.checkpoints
        q, o, m = state.position, state.round, state.index
        filling = o == c
        more = xp.where(filling, q < c - 1, m + 1 < o)  # the fill or the round goes on
        q = xp.where(more, q + 1, q + 2)  # a new round skips one position
        o = xp.where(more, o, xp.where(filling, c - 1, o - 1))
        m = xp.where(more & ~filling, m + 1, 0)
        slot = xp.where(more & filling, q, xp.where(m == 0, o, m))
        if not self.later_phases:
            q = xp.where(o == 0, self.steps, q)  # after the last round: none
        return state._replace(position=ops.int(q), slot=ops.int(slot), round=ops.int(o),
                              index=ops.int(m))  # fmt: skip

    def phase_start(self, r, ops: Ops = NUMPY) -> OnlineStore:
        """The state at the first store of phase `r >= 3`. Before it, the held positions are
        the targets of phase `r - 1`, `P_k = sum_{j<k} beta(c-j, r-2)`, in the slots where the
        rounds leave them at `r = 3`. (The slots are labels the rule carries along: for a
        later phase, whose sorted positions are all a cost needs, they are those of `r = 3`.)
        """
        xp, c = ops.xp, self.checkpoints
        table = ops.int(self.binomials)
        j = xp.arange(c)
        held = xp.cumsum(xp.where(j == 0, 0, table[c + 1 - j, r - 2]))
        slots = xp.where(j == 0, 0, c - j)
        zero = ops.int(0)
        state = OnlineStore(zero, zero, zero, zero, ops.int(r), zero, ops.int(table[c, r - 1]),
                     ops.int(1), ops.int(held), ops.int(slots), j == 0)  # fmt: skip
        return self._pending(state, ops)

    def _pending(self, state: OnlineStore, ops: Ops) -> OnlineStore:
        """The next store of the rule (`_release_rule`) from the held positions."""
        xp, c, r = ops.xp, self.checkpoints, state.phase
        table = ops.int(self.binomials)
        held, i = state.held, xp.arange(c)
        last = held[c - 1]
        d = state.target - last
        # every r steps, r + 1 while the distance to the target is not a multiple of r
        q = last + xp.where((d % r != 0) & (d > r), r + 1, xp.minimum(r, d))
        merged = xp.where(i == c - 1, q, xp.roll(held, -1)) - xp.roll(held, 1)
        over = merged - table[c + 1 - i, r - 1]
        release = _release_rule(over, (i >= 1) & ~state.pinned, self.steps + 1, xp)
        return state._replace(position=ops.int(q), slot=state.slots[release],
                              release=ops.int(release))  # fmt: skip

    def _apply(self, state: OnlineStore, ops: Ops) -> OnlineStore:
        """`state` after its store: the released snapshot leaves `held`, the new one joins it
        at the end, pinned if it is the target; a stored target moves the target on, and the
        last one of the phase starts the next phase."""
        xp, c, r, k = ops.xp, self.checkpoints, state.phase, state.target_index
        table = ops.int(self.binomials)
        i = xp.arange(c)
        reached = state.position == state.target
        leave = lambda x, new: xp.where(
            i >= state.release, xp.where(i == c - 1, new, xp.roll(x, -1)), x
        )
        held = leave(state.held, state.position)
        slots = leave(state.slots, state.slot)
        pinned = leave(state.pinned, reached)
        done = reached & (k == c - 1)
        # P_{k+1} = P_k + beta(c-k, r-1), exact for a phase that starts before `steps` (below
        # 2 * steps); the next phase's P_1 is beta(c, r)
        target = xp.where(done, table[c, r], state.target + table[c - k, r - 1])
        return state._replace(
            phase=ops.int(xp.where(done, r + 1, r)),
            target=ops.int(xp.where(reached, target, state.target)),
            target_index=ops.int(xp.where(reached, xp.where(done, 1, k + 1), k)),
            held=ops.int(held), slots=ops.int(slots), pinned=xp.where(done, i == 0, pinned),
        )  # fmt: skip


def _release_rule(over, candidate, big: int, xp):
    """The index `i` of the snapshot a store releases in phases `r >= 3` (Stumm & Walther's
    second algorithm, our variant): the latest one that is a `candidate` (not pinned: neither
    position 0 nor a stored target) whose two neighbouring segments, merged, still fit the
    upper bound `beta(c-i+1, r-1)` of the merged segment (`over <= 0`, `over` the merged length
    less the bound), else (a fallback the checks of `c <= 60` never reach) the least
    overflowing merge, the latest on ties (`big` exceeds every `over`).
    """
    c = over.shape[0]
    fits = candidate & (over <= 0)
    latest_fit = c - 1 - xp.argmax(fits[::-1])
    least = c - 1 - xp.argmin(xp.where(candidate, over, big)[::-1])
    return xp.where(xp.any(fits), latest_fit, least)


@functools.lru_cache(maxsize=64)
def online_schedule(max_steps: int, c: int) -> OnlineSchedule:
    """An online schedule for any stopping step `n <= max_steps` with `c` snapshots.

    Phases by repetition number `r`, with `beta(s, r) = C(s+r, r)`, `A = beta(c, 2)` and
    `B = beta(c, 3)`; the cost is compared with the offline optimum `t(n, c)`:

    1. `n <= c + 1`: store every state (slots `0..c-1`). Optimal.
    2. `n <= A` (`r = 2`): Stumm & Walther's first algorithm. After the fill, rounds
        `o = c-1, ..., 1` each skip one state and then store the next `o` states, the first in
        slot `o` and the rest in slots `1, ..., o-1`. Optimal: `t(n, c)` at every `n`.
    3. `A < n <= B` (`r = 3`): our variant of Stumm & Walther's second algorithm (the rule
        is in `OnlineSchedule`). Cost `t(n, c) + 1` at worst, at about one stop in three, for
        every `c` we checked (`2..60`). No online schedule does better: `t(n, c)` at every
        `n` in `(A, B]` is impossible (see `docs/checkpointing.md`).
    4. `n > B` (`r >= 4`): the same rule, one phase per repetition number, a few percent above
        `t(n, c)` (the measured excess, and Wang, Moin & Iaccarino's for comparison, are in
        `docs/checkpointing.md`).

    **Example:**

    ```python
    >>> from odeckpt.checkpointing.schedules import online_schedule
    >>> s = online_schedule(20, 3)
    >>> s.positions(10), s.positions(20)
    ((0, 4, 7), (0, 10, 16))

    ```
    """
    check_counts(max_steps, c)
    return OnlineSchedule(c, max_steps)
