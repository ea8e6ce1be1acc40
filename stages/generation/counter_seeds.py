"""Counter-based randomness of a rollout (`seeding="counter"`; the `async` schedule always uses it).

Under the default stream seeding one numpy generator serves the whole rollout: each round draws the generate call's
seed (a request gets `seed + its index in the call`) and then every branch draw of every group, in round order. That
ties each draw to the batch a request rode in and to the order the groups' rounds close, which is what the `async`
schedule changes. Counter seeding ties every draw to counters that do not depend on timing:

- a request's sampling seed derives from (tree seed, phase, trajectory id, the trajectory's segment number): the
  same trajectory's same segment gets the same seed whichever batch carries it and whenever it runs;
- each group draws its branches from its own generator, seeded by (tree seed, the group's position in the call),
  consumed at each of the group's round closes in creation order (the growth rule is unchanged);
- trajectory ids are counted per group (position x n + the group's own counter), so a group's ids do not depend
  on when other groups create theirs; within a group they stay in creation order;
- AEPO's probe (which runs before any root) draws its generate seed from a generator of its own (tree seed, phase).

The tree seed is the `seed` passed to `rollout` (the trainer and verl pass one per step and prompt, so a resumed
step re-samples the same trees), else one derived from (the driver's seed, the rollout call index). Compared with
stream seeding the realised trees change once, to the same distribution: every draw is still an independent
uniform (SeedSequence hashes the counters), only which value lands where differs.
"""

from __future__ import annotations

import numpy as np

from stages.generation.rollout_state import GroupState, LiveTrajectory

SEEDINGS = ("stream", "counter")
MAIN, PROBE, PROBE_GENERATE, GROUP = 0, 1, 2, 3   # phases: keep the counters of each use apart


def derive(*counters: int) -> int:
    """A seed in [0, 2**31) from non-negative integer counters (numpy's SeedSequence hash: well mixed, stable)."""
    return int(np.random.SeedSequence([int(c) for c in counters]).generate_state(1)[0]) % 2**31


class CounterSeeds:
    """The counters of one rollout call: per-request seeds, per-group generators and per-group trajectory ids."""

    def __init__(self, tree_seed: int, groups: list[GroupState], n: int) -> None:
        self.tree_seed, self.n = int(tree_seed) % 2**63, n
        self.position = {g.item.group: i for i, g in enumerate(groups)}
        self.next_id = [0] * len(groups)
        self.generators: dict[int, np.random.Generator] = {}

    def request_seed(self, m: LiveTrajectory, phase: int) -> int:
        """The sampling seed of `m`'s next segment (call it before the segment is taken: `m.generated` counts)."""
        return derive(self.tree_seed, phase, m.traj.traj_id, m.generated)

    def group_rng(self, g: GroupState) -> np.random.Generator:
        """The generator of `g`'s branch draws (one per group, kept for the whole rollout)."""
        pos = self.position[g.item.group]
        if pos not in self.generators:
            self.generators[pos] = np.random.default_rng([self.tree_seed, GROUP, pos])
        return self.generators[pos]

    def probe_rng(self) -> np.random.Generator:
        """The generator of the growth rule's work before the roots (AEPO's probe generate seed)."""
        return np.random.default_rng([self.tree_seed, PROBE_GENERATE])

    def take_id(self, g: GroupState) -> int:
        pos = self.position[g.item.group]
        if self.next_id[pos] >= self.n:
            raise RuntimeError(f"group {g.item.group} asked for trajectory {self.next_id[pos] + 1} of n={self.n}; "
                               "a group never holds more than n (budget accounting bug)")
        self.next_id[pos] += 1
        return pos * self.n + self.next_id[pos] - 1

    def restart_ids(self) -> None:
        self.next_id = [0] * len(self.next_id)


def tree_seed_of(driver_seed: int, call_index: int, seed: int | None) -> int:
    """The rollout call's tree seed: `seed` when given, else one derived from (driver seed, call index)."""
    return int(seed) if seed is not None else derive(driver_seed % 2**63, call_index)
