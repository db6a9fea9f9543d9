"""The one placement rule (policy/placement.py): where a new kernel starts, where a restore
goes, which idle kernels move off a contended GPU, and which node a new server lands on."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from jupyter_gpushare.policy.placement import (
    GpuView,
    Need,
    Resident,
    add,
    before_cell,
    choose,
    contended,
    expected_need,
    pressure_floor,
    rank,
    rank_groups,
    rebalance,
    restore_target,
    window_mean,
)

GiB = 1 << 30


def test_load_outranks_exact_bytes_among_gpus_that_fit():
    busy = GpuView(0, room=10 * GiB + 1, load=100.0)
    idle = GpuView(1, room=4 * GiB, load=0.0)
    assert [v.gpu for v in rank([busy, idle], Need(2 * GiB))] == [1, 0]


def test_a_gpu_that_fits_beats_one_that_does_not_however_idle():
    small_idle = GpuView(0, room=1 * GiB, load=0.0)
    busy_fits = GpuView(1, room=8 * GiB, load=95.0)
    assert choose([small_idle, busy_fits], Need(2 * GiB))[0].gpu == 1


def test_where_nothing_fits_the_most_room_first_and_unknown_last():
    views = [GpuView(0, room=None), GpuView(1, room=1 * GiB, load=0), GpuView(2, room=2 * GiB, load=99)]
    assert [v.gpu for v in rank(views, Need(8 * GiB))] == [2, 1, 0]


def test_where_nothing_fits_a_saturated_gpu_loses_to_an_idle_one_with_about_as_much_room():
    # 40 GiB expected, nowhere room for it: a few GiB more (within an eighth of the need) on
    # a GPU a training keeps at 95 % do not win; a full step more room does
    need = Need(40 * GiB)
    saturated = GpuView(7, room=18 * GiB, load=95.0, kernels=4, busy=1)
    idle = GpuView(3, room=15 * GiB, load=0.0, kernels=2)
    assert [v.gpu for v in rank([saturated, idle], need)] == [3, 7]
    assert rank([saturated, GpuView(3, room=10 * GiB, load=0.0)], need)[0].gpu == 7
    assert rank([saturated, idle, GpuView(5, room=None)], need)[-1].gpu == 5


def test_where_nothing_fits_with_states_coming_back_a_gpu_it_fits_now_comes_first():
    # released states that will come back make every GPU's room negative; a new kernel
    # allocates now: a GPU with its need free now beats one with more room once the states
    # are counted and less free memory (where its first allocation would fail)
    need = Need(20 * GiB)
    counted = GpuView(2, room=-33 * GiB, room_now=10 * GiB, load=7.0)
    free_now = GpuView(4, room=-39 * GiB, room_now=24 * GiB, load=8.0)
    assert [v.gpu for v in rank([counted, free_now], need)] == [4, 2]
    # a GPU it fits with the states counted still comes first, however busy
    fits = GpuView(1, room=21 * GiB, room_now=40 * GiB, load=60.0)
    assert choose([counted, free_now, fits], need)[0].gpu == 1
    # among GPUs it fits now, load before bytes
    quiet = GpuView(3, room=-50 * GiB, room_now=22 * GiB, load=0.0)
    busy = GpuView(5, room=-10 * GiB, room_now=60 * GiB, load=95.0)
    assert choose([busy, quiet], need)[0].gpu == 3
    # without a reading of room now, room is all there is
    assert [v.gpu for v in rank([GpuView(6, room=-30 * GiB), GpuView(7, room=-20 * GiB)], need)] == [7, 6]


def test_pending_kernels_count_as_load_so_back_to_back_starts_spread():
    views = {0: GpuView(0, room=16 * GiB), 1: GpuView(1, room=16 * GiB - 1)}
    need = Need(GiB)
    first = choose(views.values(), need)[0]
    views[first.gpu] = add(first, need)
    second = choose(views.values(), need)[0]
    assert {first.gpu, second.gpu} == {0, 1}


def test_loads_within_one_step_tie_and_fewer_kernels_win():
    a = GpuView(0, room=8 * GiB, load=3.0, kernels=3)
    b = GpuView(1, room=4 * GiB, load=7.0, kernels=1)
    assert choose([a, b], Need(GiB))[0].gpu == 1


def test_over_share_gpus_rank_after_those_within():
    mine = GpuView(0, room=4 * GiB, load=80.0)
    over = GpuView(1, room=4 * GiB, load=0.0, within_share=False)
    assert choose([over, mine], Need(GiB))[0].gpu == 0


def test_restore_stays_home_when_it_fits_and_is_not_contended():
    views = {0: GpuView(0, room=8 * GiB, load=50, busy=1), 1: GpuView(1, room=8 * GiB)}
    assert restore_target({0: 2 * GiB}, views) == {}


def test_restore_leaves_a_contended_home_for_an_idle_gpu_with_room():
    views = {0: GpuView(0, room=8 * GiB, load=100, busy=2), 1: GpuView(1, room=8 * GiB),
             2: GpuView(2, room=GiB)}
    assert restore_target({0: 2 * GiB}, views) == {0: 1}
    assert restore_target({0: 2 * GiB}, views, may_move=False) == {}


def test_a_contended_home_with_nowhere_quieter_keeps_the_kernel():
    views = {0: GpuView(0, room=8 * GiB, load=100, busy=2), 1: GpuView(1, room=8 * GiB, load=100, busy=2)}
    assert restore_target({0: 2 * GiB}, views) == {}


def test_restore_without_room_at_home_moves_all_or_nothing():
    views = {0: GpuView(0, room=0), 1: GpuView(1, room=0), 2: GpuView(2, room=4 * GiB),
             3: GpuView(3, room=GiB)}
    assert restore_target({0: 3 * GiB, 1: 3 * GiB}, views) is None
    assert restore_target({0: 3 * GiB, 1: GiB}, views) == {0: 2, 1: 3}
    assert restore_target({0: 3 * GiB}, views, may_move=False) is None


def test_a_restore_that_would_leave_home_under_the_threshold_goes_where_it_keeps_it():
    # home has room for the 10 GiB state, not for it and the 8 GiB threshold: restored there,
    # the GPU's idle kernels would be released for it (and their people wait when they come
    # back); GPU 1 keeps the threshold and is no busier: the state goes there
    keep = pressure_floor({0: 80 * GiB, 1: 80 * GiB, 2: 80 * GiB}, 0.1)
    views = {0: GpuView(0, room=12 * GiB, load=30, busy=1), 1: GpuView(1, room=40 * GiB, load=30),
             2: GpuView(2, room=60 * GiB, load=80, busy=1)}
    assert restore_target({0: 10 * GiB}, views, keep=keep) == {0: 1}
    # without the threshold (pressure releases off), or with room for it, home
    assert restore_target({0: 10 * GiB}, views) == {}
    assert restore_target({0: 10 * GiB}, {**views, 0: GpuView(0, room=18 * GiB, load=30)},
                          keep=keep) == {}
    # a method that cannot move stays home
    assert restore_target({0: 10 * GiB}, views, keep=keep, may_move=False) == {}
    # only busier GPUs keep the threshold (GPU 2, 80 % SM): home, as before
    assert restore_target({0: 10 * GiB}, {0: views[0], 2: views[2]}, keep=keep) == {}
    # nowhere keeps it (GPU 1 would be left under it too): home, not a move for nothing
    assert restore_target({0: 10 * GiB}, {0: views[0], 1: GpuView(1, room=15 * GiB)},
                          keep=keep) == {}
    # a contended GPU is never the target, however roomy (home: one training, 95 % SM)
    one_training = GpuView(0, room=12 * GiB, load=95, busy=1)
    two_trainings = GpuView(1, room=40 * GiB, load=95, busy=2)
    assert restore_target({0: 10 * GiB}, {0: one_training, 1: two_trainings}, keep=keep) == {}


def test_rebalance_moves_the_longest_idle_kernel_off_a_contended_gpu_to_a_quiet_one():
    views = {0: GpuView(0, room=4 * GiB, load=100, busy=2, kernels=3),
             1: GpuView(1, room=8 * GiB, load=5), 2: GpuView(2, room=8 * GiB, load=60)}
    residents = [Resident("training", {0: 2 * GiB}, movable=False),
                 Resident("away-short", {0: GiB}, movable=True, idle_seconds=100),
                 Resident("away-long", {0: GiB}, movable=True, idle_seconds=900)]
    assert rebalance(residents, views) == [("away-long", {0: 1})]
    assert rebalance(residents, views, most=2) == [("away-long", {0: 1}), ("away-short", {0: 1})]


def test_rebalance_does_nothing_without_contention_or_a_quiet_target():
    residents = [Resident("k", {0: GiB}, movable=True, idle_seconds=900)]
    calm = {0: GpuView(0, room=GiB, load=100, busy=1), 1: GpuView(1, room=8 * GiB)}
    assert rebalance(residents, calm) == []
    crowded = {0: GpuView(0, room=GiB, load=100, busy=2), 1: GpuView(1, room=8 * GiB, load=30)}
    assert rebalance(residents, crowded) == []
    full = {0: GpuView(0, room=GiB, load=100, busy=2), 1: GpuView(1, room=GiB // 2)}
    assert rebalance(residents, full) == []


def test_moves_leave_the_pressure_threshold_free_on_their_target():
    # GPU 1 is quieter, but taking the state would leave it under the threshold (its idle
    # kernels would be released for the move); GPU 2 keeps it: the state goes there
    keep = pressure_floor({0: 80 * GiB, 1: 80 * GiB, 2: 80 * GiB}, 0.1)
    assert keep[1] == 8 * GiB
    views = {0: GpuView(0, room=8 * GiB, load=100, busy=2), 1: GpuView(1, room=12 * GiB),
             2: GpuView(2, room=20 * GiB, load=40)}
    assert restore_target({0: 6 * GiB}, views) == {0: 1}
    assert restore_target({0: 6 * GiB}, views, keep=keep) == {0: 2}
    # a busy home with room keeps the kernel rather than push a GPU below the threshold
    assert restore_target({0: 6 * GiB}, {**views, 2: GpuView(2, room=GiB)}, keep=keep) == {}
    # a home without room still moves where the state fits, below the threshold or not
    bare = {0: GpuView(0, room=0), 1: GpuView(1, room=12 * GiB)}
    assert restore_target({0: 6 * GiB}, bare, keep=keep) == {0: 1}
    # rebalance: an optional move, never below the threshold
    residents = [Resident("away", {0: 6 * GiB}, movable=True, idle_seconds=900)]
    assert rebalance(residents, views) == [("away", {0: 1})]
    assert rebalance(residents, {**views, 2: GpuView(2, room=20 * GiB, load=60)},
                     keep=keep) == []


def test_a_heavy_kernel_about_to_share_a_busy_gpu_moves_first_to_a_quiet_one_with_room():
    keep = pressure_floor({0: 80 * GiB, 1: 80 * GiB, 2: 80 * GiB}, 0.1)
    views = {0: GpuView(0, room=10 * GiB, load=95, busy=1), 1: GpuView(1, room=30 * GiB, load=60),
             2: GpuView(2, room=20 * GiB, load=5)}
    trainer = Resident("k", {0: 6 * GiB}, movable=True)
    reading = {0: 100.0, 1: 0.0, 2: 0.0}  # another kernel's cell keeps GPU 0 busy now
    # GPU 1 has more room, but was busy over the window: GPU 2, quiet, keeps the threshold
    assert before_cell(trainer, 80.0, reading, views, keep=keep) == {0: 2}
    # a light kernel (its last GPU work at 20 % SM) stays: the two would not slow much
    assert before_cell(trainer, 20.0, reading, views, keep=keep) is None
    # its GPU not busy now (a training ended): it stays
    assert before_cell(trainer, 80.0, {**reading, 0: 25.0}, views, keep=keep) is None
    # readings above 100 % (a simulated demand) count as 100, as NVML reads them
    assert before_cell(trainer, 9.0, {0: 250.0}, views, heavy=5.0) is None
    # a quiet GPU over the window that is busy now is no target
    assert before_cell(trainer, 80.0, {**reading, 2: 90.0}, views, keep=keep) is None
    # a target that would be left under the threshold is none either
    assert before_cell(Resident("k", {0: 14 * GiB}, movable=True), 80.0, reading, views,
                       keep=keep) is None
    # a kernel that may not move (running a cell, pinned, its moves this hour used) stays
    assert before_cell(Resident("k", {0: 6 * GiB}, movable=False), 80.0, reading, views) is None
    # a kernel of two GPUs moves whole or not at all
    both = Resident("w", {0: 2 * GiB, 1: 2 * GiB}, movable=True)
    wide = {**views, 3: GpuView(3, room=20 * GiB)}
    assert before_cell(both, 80.0, reading, wide) == {0: 2, 1: 3}
    assert before_cell(both, 80.0, reading, views) is None


def test_window_mean_weights_samples_by_how_long_they_held():
    samples = [(0.0, 0.0), (10.0, 100.0), (15.0, None), (20.0, 50.0)]
    assert window_mean(samples, 0.0, 20.0) == 25.0
    assert window_mean(samples, 10.0, 30.0) == (5 * 100 + 5 * 0 + 10 * 50) / 20
    assert window_mean([], 0, 10) == 0.0


def test_expected_need_cap_then_asked_then_history_then_floor():
    assert expected_need(None, 8 * GiB, [GiB], GiB // 2).bytes == 8 * GiB
    assert expected_need(3 * GiB, None, [GiB], GiB // 2).bytes == 3 * GiB
    assert expected_need(None, None, [GiB, 2 * GiB], GiB // 2).bytes == 2 * GiB
    assert expected_need(None, None, [], GiB // 2).bytes == GiB // 2
    assert expected_need(None, None, [1], GiB // 2).bytes == GiB // 2


def test_nodes_rank_by_their_best_gpus():
    need = Need(GiB)
    groups = {"a": [GpuView("a0", room=8 * GiB, load=100, busy=2)],
              "b": [GpuView("b0", room=2 * GiB, load=0)],
              "c": [GpuView("c0", room=GiB // 2, load=0)]}
    assert rank_groups(groups, need) == ["b", "a", "c"]
    assert rank_groups({"one": [GpuView("x", room=8 * GiB)], "two": [GpuView("y", room=8 * GiB),
                        GpuView("z", room=8 * GiB)]}, need, count=2) == ["two", "one"]
    # for two GPUs, the node with two idle ones, whatever the GPUs are called: a lower index
    # on the node with one idle GPU and one busy does not win it
    nodes = {"a": [GpuView(0, room=8 * GiB, load=100, kernels=1, busy=1),
                   GpuView(1, room=8 * GiB)],
             "b": [GpuView(2, room=8 * GiB), GpuView(3, room=8 * GiB)]}
    assert rank_groups(nodes, need, count=2) == ["b", "a"]


def test_a_kernel_of_several_gpus_takes_the_smallest_node_it_fits_and_one_gpu_the_best():
    """An idle 8-GPU node and an idle 5-GPU node: a 4-GPU kernel takes the 5-GPU node and
    leaves the 8-GPU one to a kernel of 8, which fits nowhere else; a 1-GPU kernel goes by the
    GPUs' keys (equal here: then the name); where the small node lacks room, or its SMs are
    contended, the large one."""
    need = Need(10 * GiB)
    idle = {"big": [GpuView(f"b{i}", room=80 * GiB) for i in range(8)],
            "small": [GpuView(f"s{i}", room=80 * GiB) for i in range(5)]}
    assert rank_groups(idle, need, count=4) == ["small", "big"]
    assert rank_groups(idle, need, count=8) == ["big", "small"]
    assert rank_groups(idle, need, count=1) == ["big", "small"]
    short = {**idle, "small": [GpuView(f"s{i}", room=5 * GiB) for i in range(5)]}
    assert rank_groups(short, need, count=4) == ["big", "small"]
    busy = {**idle, "small": [GpuView(f"s{i}", room=80 * GiB, load=95, busy=2) for i in range(5)]}
    assert rank_groups(busy, need, count=4) == ["big", "small"]  # its SMs are contended


views_st = st.dictionaries(
    st.integers(0, 7),
    st.tuples(st.one_of(st.none(), st.integers(0, 16)), st.floats(0, 100), st.integers(0, 3)),
    min_size=1, max_size=8)


@given(views_st, st.integers(1, 8))
def test_the_chosen_gpu_is_never_beaten_by_a_fitting_gpu_with_a_lower_load_step(raw, need_gib):
    views = [GpuView(g, room=None if r is None else r * GiB, load=load, busy=b)
             for g, (r, load, b) in raw.items()]
    need = Need(need_gib * GiB)
    best = choose(views, need)[0]
    for v in views:
        if v.room is not None and v.room >= need.bytes and best.within_share == v.within_share:
            assert best.room is not None and best.room >= need.bytes
            assert int(best.expected // 10) <= int(v.expected // 10)


@given(views_st, st.dictionaries(st.integers(0, 7), st.integers(1, 8), min_size=1, max_size=3))
def test_a_restore_plan_is_all_or_nothing_and_lands_where_it_fits(raw, want_gib):
    views = {g: GpuView(g, room=None if r is None else r * GiB, load=load, busy=b)
             for g, (r, load, b) in raw.items()}
    want = {g: n * GiB for g, n in want_gib.items()}
    plan = restore_target(want, views)
    if plan is None:
        return
    targets = list(plan.values())
    assert len(set(targets)) == len(targets) and not set(targets) & set(want)
    for src, dst in plan.items():
        assert views[dst].room is not None and views[dst].room >= want[src]
    for g in want:
        if g not in plan and g in views and not contended(views[g]):
            assert views[g].room is None or views[g].room >= want[g]


def _rebalance_by_hand(residents, views, keep, most):
    """The rebalance rule as first written (every candidate ranked at every step): the
    faster rule must plan exactly these moves."""
    placed = dict(views)
    hot = [g for g, v in placed.items() if contended(v)]
    out, moved = [], set()
    for g in sorted(hot, key=lambda g: (-placed[g].load, g)):
        n = 0
        for r in sorted(residents, key=lambda r: (-r.idle_seconds, r.kernel)):
            if n >= most:
                break
            if not r.movable or r.kernel in moved or g not in r.gpus:
                continue
            plan, taken = {}, set(r.gpus)
            for s in sorted(r.gpus, key=lambda s: (-r.gpus[s], s)):
                options = [v for t, v in placed.items() if t not in taken
                           and v.room is not None and v.room >= r.gpus[s] + keep.get(t, 0)
                           and v.expected <= 25.0 and not contended(v)]
                best = rank(options, r.gpus[s])
                if not best:
                    plan = None
                    break
                plan[s] = best[0].gpu
                taken.add(best[0].gpu)
            if plan is None:
                continue
            for src, dst in plan.items():
                placed[dst] = add(placed[dst], Need(r.gpus[src], 0.0))
            out.append((r.kernel, plan))
            moved.add(r.kernel)
            n += 1
    return out


node_st = st.dictionaries(  # GPU -> (room GiB, load, pending, kernels computing): many hot
    st.integers(0, 5),
    st.tuples(st.one_of(st.none(), st.integers(0, 12)), st.sampled_from([0.0, 20.0, 100.0, 100.0]),
              st.sampled_from([0.0, 0.0, 10.0, 50.0]), st.sampled_from([0, 2, 3])),
    min_size=3,
)
residents_st = st.lists(  # (GiB per GPU, movable, idle seconds)
    st.tuples(st.dictionaries(st.integers(0, 5), st.integers(1, 6), min_size=1, max_size=2),
              st.sampled_from([True, True, False]), st.integers(0, 5)),
    min_size=2, max_size=10,
)


@settings(max_examples=300)  # about one in five plans a move
@given(node_st, residents_st, st.integers(0, 3), st.integers(1, 2))
def test_rebalance_plans_the_moves_of_the_rule_as_first_written(raw, rs, keep_gib, most):
    views = {g: GpuView(g, None if room is None else room * GiB, load=load, pending=pending,
                        kernels=busy, busy=busy) for g, (room, load, pending, busy) in raw.items()}
    residents = [Resident(f"k{i}", {g: n * GiB for g, n in gpus.items()}, movable, float(idle))
                 for i, (gpus, movable, idle) in enumerate(rs)]
    keep = {g: keep_gib * GiB for g in raw}
    assert (rebalance(residents, views, keep=keep, most=most)
            == _rebalance_by_hand(residents, views, keep, most))
