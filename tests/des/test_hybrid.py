"""A hybrid cluster in the simulator: colocated, prefill and decode instances at once, the policy's
`pd_route` choosing per request whether it runs colocated or split (`tetri.scheduling.routing`), and
flips between the three roles under load. Every run checks the KV invariants at every instant."""

from __future__ import annotations

import dataclasses

import pytest

from tetri.des.cluster import ClusterConfig, simulate
from tetri.des.experiments import TETRI_POLICY
from tetri.des.records import RunResult
from tetri.des.workloads import make_workload
from tetri.scheduling.flip import FlipDecision

from .test_des import Scripted, check_conservation

# gpu0 prefill, gpu1 decode, gpu2 and gpu3 colocated
HYBRID = ClusterConfig(
    instances=4,
    prefill_instances=1,
    colocated_instances=2,
    policy=TETRI_POLICY.changed(colocated_schedule="vllm-v1", pd_route="length", pd_prompt_tokens=100),
)
SPLIT, COLOCATED = {"gpu0"}, {"gpu2", "gpu3"}


def _paths(res: RunResult) -> dict[str, str]:
    out = {}
    for r in res.requests:
        if r.prefill_instance in SPLIT:
            assert r.decode_instance in ({"gpu1"} if r.output_len > 1 else {None})
            out[r.request_id] = "split"
        else:
            assert r.prefill_instance in COLOCATED
            assert r.decode_instance == (r.prefill_instance if r.output_len > 1 else None)
            out[r.request_id] = "colocated"
    return out


def test_length_route_splits_the_long_prompts_and_keeps_the_short_colocated():
    reqs = make_workload("Mixed", 200, seed=1, rate=2.0)  # a light load: no path backs up
    res = simulate(reqs, HYBRID, check_kv=True)
    check_conservation(reqs, res)
    paths = _paths(res)
    for r in reqs:
        assert paths[r.request_id] == ("split" if r.prompt_len >= 100 else "colocated"), r
    assert set(paths.values()) == {"split", "colocated"}
    assert {i.instance_id: i.roles for i in res.instances}["gpu2"] == ("colocated",)


@pytest.mark.parametrize(("route", "path"), [("role", "colocated"), ("split", "split")])
def test_role_and_split_routes_send_everything_one_way(route: str, path: str):
    reqs = make_workload("Mixed", 120, seed=2, rate=2.0)
    res = simulate(reqs, dataclasses.replace(HYBRID, policy=HYBRID.policy.changed(pd_route=route)))
    check_conservation(reqs, res)
    assert set(_paths(res).values()) == {path}


def test_a_backed_up_path_sends_requests_the_other_way_only_with_a_slack():
    reqs = make_workload("Mixed", 200, seed=3, rate=float("inf"))  # a burst: both paths back up
    by_length = {r.request_id: "split" if r.prompt_len >= 100 else "colocated" for r in reqs}
    strict = _paths(simulate(reqs, HYBRID, check_kv=True))
    assert strict == by_length  # pd_backlog_slack 0: the length alone decides
    guarded = dataclasses.replace(HYBRID, policy=HYBRID.policy.changed(pd_backlog_slack=4))
    res = simulate(reqs, guarded, check_kv=True)
    check_conservation(reqs, res)
    paths = _paths(res)
    moved = [rid for rid, path in paths.items() if path != by_length[rid]]
    # the guard sent requests the other way once their path had more than 4 more waiting (here the short
    # ones, the colocated instances backing up first), and most still go by their length
    assert moved and len(moved) < len(reqs) / 2


def test_flips_between_the_three_roles_under_load_lose_nothing():
    reqs = make_workload("Mixed", 300, seed=7, rate=3.0)
    watcher = Scripted(
        [
            (5.0, FlipDecision("gpu3", "decode", "test: colocated → decode")),
            # refused: gpu3 drains, so gpu1 is the last active decode instance and gpu0 hands over to it
            (5.0, FlipDecision("gpu1", "colocated", "test: refused")),
            (20.0, FlipDecision("gpu0", "colocated", "test: prefill → colocated")),
        ]
    )
    res = simulate(reqs, HYBRID, watcher=watcher, check_kv=True)
    check_conservation(reqs, res)
    flips = {(f.instance_id, f.from_role, f.to_role) for f in res.flips}
    assert flips == {("gpu3", "colocated", "decode"), ("gpu0", "prefill", "colocated")}
    roles = {i.instance_id: i.roles for i in res.instances}
    assert roles["gpu3"] == ("colocated", "decode") and roles["gpu0"] == ("prefill", "colocated")
    done = {f.instance_id: f.done for f in res.flips}
    late = [r for r in res.requests if r.arrival > done["gpu0"] + 1]
    # once gpu0 is colocated no prefill instance is left: everything runs colocated, on gpu0 among others
    assert late and all(r.prefill_instance in {"gpu0", "gpu2"} for r in late)
    assert any(r.prefill_instance == "gpu0" for r in late)
    # between the flips, gpu3 decoded what gpu0 prefilled
    assert any(r.decode_instance == "gpu3" and r.prefill_instance == "gpu0" for r in res.requests)


def test_a_decode_instance_does_not_flip_away_from_a_draining_prefill_instance():
    """Flips asked at once: the prefill instance drains toward colocated, so the only decode instance must
    stay (its held KV goes there); the simulation ends, every request served."""
    reqs = make_workload("Mixed", 200, seed=4, rate=3.0)
    cfg = dataclasses.replace(HYBRID, instances=3, colocated_instances=1)  # gpu0 P, gpu1 D, gpu2 C
    watcher = Scripted(
        [(5.0, FlipDecision("gpu0", "colocated", "test")), (5.0, FlipDecision("gpu1", "colocated", "test: refused"))]
    )
    res = simulate(reqs, cfg, watcher=watcher, check_kv=True)
    check_conservation(reqs, res)
    assert [(f.instance_id, f.to_role) for f in res.flips] == [("gpu0", "colocated")]


def test_a_prefill_instance_whose_last_work_was_rejected_finishes_its_flip():
    reqs = [r for r in make_workload("HPLD", 80, seed=5, rate=float("inf"))]
    pol = TETRI_POLICY.changed(ttft_target_s=0.05, ttft_miss="reject")
    cfg = ClusterConfig(instances=3, prefill_instances=2, policy=pol)
    res = simulate(reqs, cfg, watcher=Scripted([(0.01, FlipDecision("gpu0", "decode", "test"))]), check_kv=True)
    assert res.rejected and any(x.instance == "gpu0" for x in res.rejected)
    assert [(f.instance_id, f.to_role) for f in res.flips] == [("gpu0", "decode")]
    assert len(res.requests) + len(res.rejected) == len(reqs)
