"""The site workload of the adaptation demo: distinct, reproducible, and disjoint from the generic robot set."""

from __future__ import annotations

from edgespec.distill.workload import robot_prompts, site_prompts


def test_site_prompts_are_distinct_seeded_and_new_to_the_generic_workload() -> None:
    a = site_prompts(40, seed=3)
    assert len(set(a)) == 40 and a == site_prompts(40, seed=3) and a != site_prompts(40, seed=4)
    assert not set(a) & set(robot_prompts(200))
    assert all("sku_ref" in t or "counted" in t for t in a)
