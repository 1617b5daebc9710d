"""The daemon's routing index (`Registry.entry`, `Registry.healthy`, `Registry.catalog`) against the rule it
replaced, a scan of the whole registry per request: through any sequence of registrations, reports
(loads, states, roles), routed and finished requests, failed calls, flips and removals, both choose the
same instance, exactly."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.cluster import Instance, LoadReport, Registration
from daemon.controller.registry import Registry
from daemon.front.route import Router
from tetri.scheduling.policyset import PolicySet
from tetri.scheduling.routing import PD_ROUTES, choose_path, least_loaded

IDS = [f"w{i}" for i in range(7)]
MODELS = ["m1", "m2"]
ROLES = ["prefill", "decode", "colocated"]


def scan(cluster: Registry, role: str, model: str | None = None) -> list[Instance]:
    return [
        i
        for i in cluster.instances.values()
        if i.role == role and i.state == "active" and (model is None or i.model == model)
    ]


def scan_entry(cluster: Registry, model: str, exclude: frozenset[str], prompt_len: int = 0) -> str | None:
    """The least-loaded colocated and prefill entries by a scan; the policies' route between them."""
    colocated = [i.snapshot() for i in scan(cluster, "colocated", model) if i.id not in exclude]
    prefill = [i.snapshot() for i in scan(cluster, "prefill", model) if i.id not in exclude]
    c = least_loaded(colocated)
    p = least_loaded(prefill) if scan(cluster, "decode", model) else None
    if c is None or p is None:
        return c if c is not None else p
    pol = cluster.policies
    c_load = next(x for x in colocated if x.instance_id == c)
    p_load = next(x for x in prefill if x.instance_id == p)
    path = choose_path(
        pol.pd_route, prompt_len, None, c_load, p_load, pol.pd_prompt_tokens, pol.pd_output_tokens, pol.pd_backlog_slack
    )
    return c if path == "colocated" else p


ident = st.sampled_from(IDS)
op = st.one_of(
    st.tuples(
        st.just("register"),
        ident,
        st.sampled_from(ROLES),
        st.sampled_from(MODELS),
        st.integers(0, 2),
        st.integers(0, 2),
    ),
    st.tuples(
        st.just("report"),
        ident,
        st.integers(0, 3),
        st.integers(0, 500),
        st.sampled_from(["active", "active", "draining"]),
        st.sampled_from(["", *ROLES]),
    ),
    st.tuples(st.just("routed"), ident, st.sampled_from([1, 1, -1])),
    st.tuples(st.just("suspect"), ident),
    st.tuples(st.just("flip"), ident, st.booleans()),
    st.tuples(st.just("expire"), ident),
    st.tuples(st.just("entry"), st.sampled_from(MODELS), st.frozensets(ident, max_size=2), st.sampled_from([10, 2000])),
    st.tuples(st.just("policy"), st.sampled_from(PD_ROUTES), st.sampled_from([0, 1, 4])),
)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(ROLES), st.sampled_from(MODELS)), min_size=3, max_size=7),
    st.lists(op, max_size=60),
)
def test_the_index_routes_as_the_registry_scan_did(start: list[tuple[str, str]], ops: list[tuple]) -> None:
    cluster = Registry(report_interval_s=0.1, unhealthy_after=3)
    for iid, (role, model) in zip(IDS, start, strict=False):
        cluster.register(Registration(iid, role, f"h:{iid}", model, 1024, 1000))
    for o in ops:
        kind, iid = o[0], o[1]
        inst = cluster.instances.get(iid)
        if kind == "register":
            _, _, role, model, ctx, vocab = o
            cluster.register(Registration(iid, role, f"h:{iid}", model, 1024 * ctx, 1000, vocab_size=100 * vocab))
        elif kind == "report" and inst is not None:
            _, _, queued, kv, state, role = o
            cluster.report(LoadReport(iid, role, state, queued=queued, kv_used_tokens=kv, kv_capacity_tokens=1000))
        elif kind == "routed" and inst is not None:
            cluster.routed(inst, o[2])
        elif kind == "suspect":
            cluster.suspect(iid)
        elif kind == "flip" and inst is not None:  # as daemon.controller.flips does: start, then end (done or not)
            if not inst.flip_pending:
                cluster.begin_flip(inst)
            else:
                cluster.end_flip(inst, ("decode" if inst.role == "prefill" else "prefill") if o[2] else None)
        elif kind == "expire" and inst is not None:  # silent past the dead limit: removed
            inst.last_report = -1e9
            cluster.check_health()
        elif kind == "entry":
            model, exclude, prompt = o[1], o[2], o[3]
            got = Router(cluster).pick(model, exclude, range(prompt))
            assert (None if got is None else got.id) == scan_entry(cluster, model, exclude, prompt)
        elif kind == "policy":  # a hot swap of the per-request P/D choice
            cluster.set_policies(PolicySet(pd_route=o[1], pd_prompt_tokens=512, pd_backlog_slack=o[2]))
        for model in MODELS:  # after every step, each model's choice, with and without exclusions
            for exclude in (frozenset(), frozenset(IDS[:2])):
                for prompt in (10, 2000):
                    got = Router(cluster).pick(model, exclude, range(prompt))  # the index is empty: no cache hits
                    assert (None if got is None else got.id) == scan_entry(cluster, model, exclude, prompt)
        for role in ROLES:
            for model in (None, *MODELS):
                assert sorted(i.id for i in cluster.healthy(role, model=model)) == sorted(
                    i.id for i in scan(cluster, role, model)
                )
        for model in MODELS:
            insts = [i for i in cluster.instances.values() if i.model == model]
            entry = cluster.catalog().get(model)
            assert (entry is None) == (not insts)
            if entry is not None:
                assert entry.context == min(i.max_model_len for i in insts)
                assert entry.vocab_size == min((i.vocab_size for i in insts if i.vocab_size), default=None)
                assert entry.roles == {i.role for i in insts}
