"""The planner's family of instances (`planner.generator.family`, issue 40's first part): drawn
from a seed, feasible by construction, and the planted plan is the certificate. The certificate
is checked by `planner.validate.check_plan` (the constraints the planner promises), never by the
planner itself; the draws cover the family's ranges."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from ipnext.planner.generator import TIGHT, family, tight_family
from ipnext.planner.validate import check_plan

SEEDS = range(40)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_planted_plan_fits_every_pool_and_constraint(seed: int) -> None:
    small = family(seed, deployments=40 + seed % 5 * 10)
    assert check_plan(small.problem, small.planted) == []
    assert 0 < small.fullness <= 1 and small.planted.cost > 0


def test_the_draws_cover_the_family() -> None:
    drawn = [family(seed) for seed in range(12)]
    for inst in drawn:
        assert 100 <= len(inst.problem.deployments) <= 1000
        assert 4 <= len(inst.problem.fleet.regions) <= 16 and 2 <= len(inst.problem.fleet.hardware) <= 4
        assert check_plan(inst.problem, inst.planted) == []
    sizes = [len(i.problem.deployments) for i in drawn]
    assert max(sizes) - min(sizes) > 300  # not one row
    deployments = [d for inst in drawn for d in inst.problem.deployments]
    assert Counter(d.min_regions for d in deployments).keys() >= {1, 2, 3}
    assert 0.15 < sum(d.survive_region_loss for d in deployments) / len(deployments) < 0.45
    assert sum(d.group is not None for d in deployments) / len(deployments) > 0.3


def test_nearly_full_pools_are_what_was_asked() -> None:
    for seed in range(6):
        inst = family(seed, deployments=120, fullness=0.98)
        assert 0.9 <= inst.fullness <= 0.98 + 1e-9, inst.fullness
        assert check_plan(inst.problem, inst.planted) == []


def test_a_tight_instance_is_90_to_98_percent_full_and_repeats() -> None:
    """Seeds whose first draw of the fullness asked lands under 90% once rounded (730094931,
    179460442) and one whose first draw is kept (675114897, as `family` gives it)."""
    for seed in (730094931, 179460442, 675114897):
        inst = tight_family(seed)
        assert TIGHT[0] <= inst.fullness <= TIGHT[1], (seed, inst.fullness)
        assert inst == tight_family(seed)
    kept = random.Random(675114897).uniform(*TIGHT)
    assert tight_family(675114897) == family(675114897, fullness=kept)
    assert family(730094931, fullness=random.Random(730094931).uniform(*TIGHT)).fullness < TIGHT[0]


def test_the_latency_budgets_are_tight() -> None:
    """Each budget is at most 15% above the slowest route the planted plan needs, and often
    exactly that: the planted routing leaves little room."""
    inst = family(7, deployments=200)
    exact = 0
    for dep in inst.problem.deployments:
        slowest = max(
            inst.problem.fleet.latency(source, region)
            for source, row in inst.planted.deployments[dep.name].fractions.items()
            for region in row
        )
        assert slowest <= dep.latency_budget_ms <= slowest * 1.15 + 0.1
        exact += dep.latency_budget_ms <= slowest + 0.1
    assert exact > len(inst.problem.deployments) * 0.25


def test_the_same_seed_draws_the_same_instance() -> None:
    assert family(3, deployments=50) == family(3, deployments=50)
    assert family(3, deployments=50).problem != family(4, deployments=50).problem


def test_a_planted_plan_that_oversteps_a_pool_is_caught() -> None:
    """The certificate's check can fail: one pool shrunk below what the planted plan uses."""
    inst = family(5, deployments=60)
    pools = list(inst.problem.fleet.pools)
    used = {(r, h) for p in inst.planted.deployments.values() for r, by in p.replicas.items() for h in by}
    i = next(k for k, p in enumerate(pools) if (p.region, p.hardware) in used and p.units > 1)
    pools[i] = pools[i].model_copy(update={"units": 1})
    shrunk = inst.problem.model_copy(update={"fleet": inst.problem.fleet.model_copy(update={"pools": pools})})
    assert any(
        line.startswith(f"pool {pools[i].region}/{pools[i].hardware}")
        for line in check_plan(shrunk, inst.planted)
    )
