"""Fair shares and cross-user make-room: cases worked out by hand, and the rules as properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jupyter_gpushare import policy
from jupyter_gpushare.policy import crossuser
from jupyter_gpushare.policy.fairshare import Ledger, Share, parse_share, parse_table, shares_of

GiB = 1 << 30


# -- parsing -------------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "share"), [
    (8 * GiB, Share("gpu", amount=8 * GiB, source="k")),
    ("8GiB", Share("gpu", amount=8 * GiB, source="k")),
    ("512 MiB", Share("gpu", amount=512 << 20, source="k")),
    ("1.5 GB", Share("gpu", amount=1_500_000_000, source="k")),
    ("25%", Share("gpu", fraction=0.25, source="k")),
    ("40 GiB per node", Share("node", amount=40 * GiB, source="k")),
    ("40GiB/node", Share("node", amount=40 * GiB, source="k")),
    ("10% per node", Share("node", fraction=0.1, source="k")),
])
def test_share_amounts(value, share):
    assert parse_share(value, "k") == share


@pytest.mark.parametrize("value", [-1, True, "lots", "150%", "8 GiB per rack", 1.5, None, "8 XB"])
def test_bad_share_amounts_say_which(value):
    with pytest.raises(ValueError, match="share 'alice'"):
        parse_share(value, "alice")


def test_bad_share_keys():
    with pytest.raises(ValueError, match="not a user, group:NAME or"):
        parse_table({"group:": "1GiB"})
    assert parse_table({}) == {}


def test_whose_share_applies():
    table = parse_table({"alice": "8GiB", "group:a": "4GiB", "group:b": "50%", "*": "1GiB"})
    assert shares_of("alice", ["a"], table) == [table["alice"]]  # her own entry wins
    assert shares_of("dave", ["b", "a", "zz"], table) == [table["group:a"], table["group:b"]]
    assert shares_of("erin", ["zz"], table) == [table["*"]]
    assert shares_of("erin", [], parse_table({"alice": "1GiB"})) == []


def ledger(usage, table, totals=None, nodes=None) -> Ledger:
    totals = totals or {0: 16 * GiB, 1: 16 * GiB}
    shares = parse_table(table)
    groups = {"dave": ["a", "b"]}
    return Ledger(totals, nodes or dict.fromkeys(totals, "n1"), usage,
                  {u: shares_of(u, groups.get(u, []), shares) for u in {*usage, "alice", "bob", "carol", "dave"}},
                  enabled=bool(shares))


def test_headroom_per_gpu_per_node_and_groups():
    book = ledger(
        {"alice": {0: 6 * GiB}, "bob": {0: 1 * GiB}, "carol": {0: 12 * GiB, 1: 6 * GiB},
         "dave": {1: 5 * GiB}},
        {"alice": "8GiB", "carol": "20GiB per node", "group:a": "4GiB", "group:b": "50%"})
    # alice: 8 GiB per GPU, 6 used on GPU 0 -> 2 GiB left there, 8 on GPU 1
    assert (book.headroom("alice", 0), book.headroom("alice", 1)) == (2 * GiB, 8 * GiB)
    assert book.within("alice", 0, 2 * GiB) and not book.within("alice", 0, 3 * GiB)
    # bob: no entry and no "*": guaranteed nothing, so the 1 GiB he holds is over
    assert book.headroom("bob", 0) == -1 * GiB and book.over("bob", 0)
    assert not book.over("bob", 1) and not book.within("bob", 1, 1)
    # carol: 20 GiB per node, 12 + 6 used on the node -> 2 GiB left on either GPU
    assert book.headroom("carol", 0) == book.headroom("carol", 1) == 2 * GiB
    # dave: groups a (4 GiB) and b (50 % of 16 GiB = 8 GiB): the more generous, 8 - 5 = 3
    assert book.headroom("dave", 1) == 3 * GiB


def test_no_table_means_no_one_is_over():
    book = ledger({"bob": {0: 15 * GiB}}, {})
    assert not book.over("bob", 0) and book.within("bob", 0, 15 * GiB)


# -- cross-user make-room -------------------------------------------------------------------------
CFG = crossuser.HubPolicy(
    policy.PolicyConfig(idle_timeout=600, idle_utilization=5, min_release_bytes=0,
                        pressure_free_fraction=0.1, pressure_idle_timeout=120),
    over_share_idle_timeout=30)


def k(user, kid, nbytes, idle, busy=False, pinned=False, util=0.0, gpu=0, resident=True,
      releasable=True):
    return crossuser.Holding(user, policy.Candidate(
        kernel_id=kid, resident=resident, busy=busy, pinned=pinned, idle_seconds=idle,
        max_utilization=util, gpu_bytes={gpu: nbytes}, releasable=releasable))


def usage_of(holdings):
    out: dict[str, dict[int, int]] = {}
    for h in holdings:
        if h.candidate.resident:
            for g, n in h.candidate.gpu_bytes.items():
                out.setdefault(h.user, {})[g] = out.get(h.user, {}).get(g, 0) + n
    return out


def plan(requester, need, free, holdings, table=None):
    book = ledger(usage_of(holdings), table or {})
    return crossuser.make_room(requester, need, free, holdings, book, CFG, {0: "GPU 0"})


def test_longest_idle_of_other_people_goes_and_the_active_stay():
    # GPU 0: 1 GiB free; alice needs 4 GiB -> 3 GiB short
    held = [k("bob", "b1", 4 * GiB, idle=600), k("bob", "b2", 4 * GiB, idle=60),
            k("carol", "c1", 3 * GiB, idle=0, busy=True), k("alice", "a1", 4 * GiB, idle=9999)]
    p = plan("alice", {0: 4 * GiB}, {0: 1 * GiB}, held)
    assert p.enough and [v.kernel_id for v in p.victims] == ["b1"]  # not her own a1
    assert p.victims[0].reason == "making room for alice's restore: idle for 600 s"


def test_room_after_a_cell_ran_out_of_memory_keeps_the_pressure_threshold_when_it_can():
    # one 80 GiB GPU (pressure threshold 10 %: 8 GiB), 2 GiB free; alice's cell asked for 4 GiB
    held = [k("bob", "b1", 3 * GiB, idle=900), k("bob", "b2", 9 * GiB, idle=600),
            k("carol", "c1", 20 * GiB, idle=0, busy=True)]
    book = ledger(usage_of(held), {})

    def after(free, holdings):
        return crossuser.room_after_oom("alice", {0: 4 * GiB}, {0: free}, {0: 80 * GiB},
                                        holdings, book, CFG, {0: "GPU 0"})

    p = after(2 * GiB, held)  # 4 + 8 - 2 = 10 GiB short: both of bob's go
    assert p.enough and [v.kernel_id for v in p.victims] == ["b1", "b2"]
    assert p.victims[0].reason == "making room for alice's cell, which ran out of memory: idle for 900 s"
    # only b1 may go: not the threshold, but the bytes alone (2 + 3 >= 4)
    p = after(2 * GiB, [held[0], held[2]])
    assert p.enough and [v.kernel_id for v in p.victims] == ["b1"]
    p = after(0, [held[0], held[2]])  # not even the bytes: nothing
    assert not p.enough and p.victims == [] and "GPU 0" in p.why_not
    assert after(12 * GiB, held).victims == []  # the retry fits with the threshold kept


def test_nothing_fits_says_why():
    all_active = [k("bob", "b1", 4 * GiB, idle=5), k("carol", "c1", 4 * GiB, idle=0, busy=True)]
    p = plan("alice", {0: 4 * GiB}, {0: 0}, all_active)
    assert (p.enough, p.victims) == (False, [])
    assert p.why_not == ("GPU 0 is full; of the other kernels on it, 1 was used in the last few "
                         "minutes, 1 is active")
    busy_only = plan("alice", {0: 4 * GiB}, {0: 0}, [k("carol", "c1", 8 * GiB, 0, busy=True),
                                                     k("bob", "b1", 8 * GiB, 900, util=80)])
    assert busy_only.why_not == "GPU 0 is full; the other kernels on it are active"
    mixed = plan("alice", {0: 4 * GiB}, {0: 0}, [k("bob", "b1", 4 * GiB, 600, pinned=True),
                                                 k("bob", "b2", 4 * GiB, 60),
                                                 k("carol", "c1", 3 * GiB, 0, busy=True)])
    assert mixed.why_not == ("GPU 0 is full; of the other kernels on it, 1 is pinned, "
                             "1 was used in the last few minutes, 1 is active")
    alone = plan("alice", {0: 4 * GiB}, {0: 0}, [k("alice", "a2", 16 * GiB, 9999)])
    assert alone.why_not == "GPU 0 is full; no other person's kernel holds memory there"
    small = plan("alice", {0: 8 * GiB}, {0: 0}, [k("bob", "b1", 4 * GiB, 600)])
    assert (small.enough, small.victims) == (False, [])  # all or nothing: b1 alone is not enough
    assert small.why_not.endswith("would not free enough")


def test_over_share_kernels_go_first_and_sooner():
    # shares: alice and carol 8 GiB per GPU; bob none (everything he holds is over)
    table = {"alice": "8GiB", "carol": "8GiB"}
    held = [k("bob", "b1", 4 * GiB, idle=40), k("bob", "b2", 6 * GiB, idle=50),
            k("carol", "c1", 6 * GiB, idle=3600)]
    p = plan("alice", {0: 6 * GiB}, {0: 0}, held, table)
    # bob is over his share: his kernels go first (longest idle of his first), after 30 s idle
    # instead of 120; carol, idle far longer, is within hers and stays
    assert [v.kernel_id for v in p.victims] == ["b2"]
    assert "over their share" in p.victims[0].reason


def test_nobody_within_their_share_goes_for_someone_over_theirs():
    table = {"alice": "8GiB", "carol": "8GiB"}
    held = [k("carol", "c1", 6 * GiB, idle=3600), k("alice", "a1", 4 * GiB, idle=3600)]
    p = plan("bob", {0: 4 * GiB}, {0: 0}, held, table)  # bob: no share, so he is over
    assert (p.enough, p.victims) == (False, [])
    assert p.why_not == ("GPU 0 is full; the other kernels on it are within their owners' "
                         "shares (and yours is used up)")


def test_an_owner_back_within_their_share_is_protected_again():
    table = {"alice": "8GiB", "dave": "4GiB"}
    held = [k("dave", "d1", 3 * GiB, idle=100), k("dave", "d2", 3 * GiB, idle=90)]
    # dave holds 6 GiB > 4: over. alice (within) needs 6 GiB on a full GPU: d1 goes (over,
    # idle 100 >= 30); then dave holds 3 GiB <= 4, within again: d2, idle 90 < 120, stays
    p = plan("alice", {0: 6 * GiB}, {0: 0}, held, table)
    assert not p.enough and "were used in the last few minutes" not in p.why_not
    assert p.why_not == "GPU 0 is full; the other kernel on it was used in the last few minutes"
    held = [k("dave", "d1", 3 * GiB, idle=150), k("dave", "d2", 3 * GiB, idle=200)]
    p = plan("alice", {0: 6 * GiB}, {0: 0}, held, table)
    assert [v.kernel_id for v in p.victims] == ["d2", "d1"]  # d1: within again, but 150 >= 120
    assert "over their share" in p.victims[0].reason and "over" not in p.victims[1].reason


def test_room_already_there_releases_nothing():
    assert plan("alice", {0: 1 * GiB}, {0: 2 * GiB}, [k("bob", "b1", 4 * GiB, 600)]) == \
        crossuser.Plan([], True)


holding = st.builds(
    k, user=st.sampled_from(["alice", "bob", "carol", "dave"]), kid=st.uuids().map(str),
    nbytes=st.integers(1, 8).map(lambda n: n * GiB), idle=st.floats(0, 1000),
    busy=st.booleans(), pinned=st.booleans(), util=st.sampled_from([0.0, 50.0]),
    resident=st.booleans())


@settings(max_examples=300, deadline=None)
@given(held=st.lists(holding, max_size=8), need=st.integers(1, 16),
       free=st.integers(0, 8), shares_on=st.booleans())
def test_the_rules_hold_for_any_node(held, need, free, shares_on):
    table = {"alice": "6GiB", "carol": "4GiB", "*": "1GiB"} if shares_on else {}
    book = ledger(usage_of(held), table, totals={0: 64 * GiB})
    p = crossuser.make_room("alice", {0: need * GiB}, {0: free * GiB}, held, book, CFG)
    chosen = {v.kernel_id for v in p.victims}
    freed = sum(h.candidate.bytes for h in held if h.candidate.kernel_id in chosen)
    if p.enough:
        assert free * GiB + freed >= need * GiB
    else:
        assert not p.victims and p.why_not
    for h in held:
        if h.candidate.kernel_id not in chosen:
            continue
        c = h.candidate
        assert h.user != "alice" and policy.eligible(c, CFG.base)  # nobody working goes
        assert c.idle_seconds >= CFG.over_share_idle_timeout
        if not book.within("alice", 0, need * GiB):  # alice over: only over-share owners go
            assert book.over(h.user, 0)


# -- the service's options ----------------------------------------------------------------------
def test_every_hub_option_is_documented_and_bad_values_name_it():
    from traitlets import TraitError
    from traitlets.config import Config

    from jupyter_gpushare.hub.app import GPUShareHub
    from jupyter_gpushare.node.hub_link import GPUShareHubLink

    for cls in (GPUShareHub, GPUShareHubLink):
        for name, trait in cls.class_own_traits(config=True).items():
            assert len(trait.help) > 60 and "Default" in trait.help, f"{cls.__name__}.{name}"
    for name, value in (("shares", {"alice": "lots"}), ("poll_interval", 0),
                        ("over_share_idle_timeout", -1), ("idle_utilization", 101),
                        ("concurrency", 0)):
        with pytest.raises(TraitError, match=name):
            GPUShareHub(config=Config({"GPUShareHub": {name: value}}))
    assert GPUShareHub(config=Config({"GPUShareHub": {"shares": {"group:gpu": "40GiB per node"}}})).shares
