"""Room for a restore: its turn per GPU, free memory checked (twice where other servers'
restores take no turn with ours), idle kernels released by policy to make it, or a wait
that says why. Never restore without room: a restore without room wedges a real process for
good.

Where a restore goes (the placement rule's :func:`..policy.placement.restore_target`): home
when it has room and its SMs are not contended. A contended home with a quieter GPU that has
room: onto that GPU at once. A home with room for the state but not for it and the pressure
threshold (``pressure_free_fraction``: the restore would have that GPU's idle kernels
released, whose people then wait for their own restores) with a GPU that keeps the threshold
and is no busier: onto that GPU at once. A home without room: after ``move_after`` seconds of waiting
(making room at home may be better than moving), onto the allowed GPU(s) with room and the
least load. Only where the method can restore onto other GPUs; else it stays home and the
cell and status say why.

The controller owns the restore; :meth:`RestoreRoom.find` is its waiting phase (the only
phase that can be stopped).
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import replace
from typing import TYPE_CHECKING

from .. import clock
from ..node.gpu_load import GpuLoad, coming_back
from ..policy import Candidate
from ..policy.placement import PENDING_LOAD, GpuView, contended, pressure_floor, restore_target
from ..policy.room import UNKNOWN_GPU, lacking, narrow
from ..units import format_bytes
from . import ahead
from .errors import ControllerError
from .lifecycle import Held, Lifecycle
from .operations import Operation, Outcome, wait_for
from .progress import CellProgress
from .reservations import Grant

if TYPE_CHECKING:
    from .controller import Controller

log = logging.getLogger(__name__)

WAIT_BACKOFF = (0.25, 5.0)  # s between make-room rounds: first, and the most
STRICT_SETTLE = 0.5  # s between the two readings of a restore without a turn across servers
TURNLESS_PAUSE = 1.0  # s at most, random: before a turnless restore settles for room for once
TURNLESS_AFTER = 30.0  # s, where the server's options do not say (``turnless_restore_after``)
MEMORY_WAIT = "waiting for memory"
LOAD_WINDOW = 120.0  # s, where the server's options do not say (``load_window``)


class RestoreRoom:
    def __init__(self, controller: Controller):
        self.c = controller
        tracker = controller.tracker
        #: each GPU's load and this server's placements: one for the placer, the restores
        #: and the rebalancer (the server's ``load_window`` option)
        self.load = GpuLoad(lambda: tracker.gpus, lambda: tracker.kernels,
                            float(getattr(controller.config, "load_window", LOAD_WINDOW)),
                            ended=lambda: getattr(tracker, "ended", ()))
        self._told_uncovered: set[int] = set()  # GPUs whose uncovered turns the log has said

    async def find(
        self, st: Lifecycle, op: Operation, held: Held, need: dict[int, int], shown: CellProgress,
        wait: bool, again: str = "",
    ) -> Grant | Outcome:
        """Never restore without room: take the GPUs, check, reserve; else make room per
        policy, or wait and say why. An Outcome when it ends without room. ``again``: why
        the restore waits once more (its room was taken right before the method's call):
        said already (event, cell), added to ``waiting``; its wait counts from its first
        (``st.short_since``)."""
        announced = bool(again)
        delay = WAIT_BACKOFF[0]
        short_since = st.short_since  # when the kernel's own GPUs were first seen full
        weighed = False  # whether a contended or tight home was weighed against other GPUs
        twice_since: float | None = None  # when room for once (not twice, without a turn) was seen
        told_once = False  # whether the cell was told it settles for room for once
        stays = ""  # why it stays on a contended home (said in the cell and status)
        while True:
            # Python 3.11's wait_for can swallow a cancel that lands as what it waits for
            # completes (a release ending as the server shuts down): look at the flag too
            if op.stopped:
                raise asyncio.CancelledError
            if st.held is not held:
                return Outcome(False, f"{st.error or 'the held state was dropped'}", False, dropped=True)
            if ahead.yields(self.c, st, op, need):  # a cell's restore waits for these GPUs: it goes first
                try:
                    await asyncio.wait_for(self.c.freed.wait(), WAIT_BACKOFF[1])
                except asyncio.TimeoutError:
                    pass
                continue
            if not weighed:
                weighed = True
                moved, stays = await self.off_home(st, op, held, need, shown)
                if moved is not None:
                    return moved
            # a turn behind another restore of this server on the same GPU is not `waiting`
            # (the other one moves its bytes and gives the GPU back); a turn another server
            # holds is (it may keep it): the cell and status say so
            grant = await self.take_turn(st, need, shown)
            want = need
            strict = set(grant.unguarded) & set(need)  # no turn across servers on these GPUs
            careful: set[int] = set()
            if strict and self.settles_for_once(twice_since):
                # twice the room never came: room for once, seen three times, will do
                careful, strict = strict, set()
                if not told_once:
                    told_once = True
                    await shown(_settling(grant, careful, self.turnless_after))
            try:
                want = await self.still_to_land(st, held, need)
                free, room, short = await self.check(want, strict, careful)
            except asyncio.CancelledError:  # stopped while reading: leave no GPU locked
                grant.release()
                raise
            except Exception as e:
                log.warning("gpushare: cannot read free GPU memory: %s", e)
                free = {g: None for g in need}
                room = {g: None for g in need}
                short = dict(want)
            if op.stopped:
                grant.release()
                raise asyncio.CancelledError
            if not short and st.held is held:
                grant.reserve(want, self.c.holds(st.kernel_id, held.kernel_pid))
                grant.why = stays
                st.waiting = None
                return grant
            grant.release()
            if not short:
                continue  # dropped meanwhile: the check at the top says so
            if strict and not lacking(want, room):  # room for once, not for twice
                twice_since = clock.now() if twice_since is None else twice_since
            elif not careful:
                twice_since = None
            shortfall = [(f"{format_bytes(n)} on GPU {g}",
                          (f"{format_bytes(max(room[g] or 0, 0))} free" if room.get(g) is not None
                           else "free memory unknown")
                          + ("; twice that without a restore turn" if g in strict else "")
                          + (f" (room for once will do after {self.turnless_after:g} s)"
                             if g in strict and self.turnless_after > 0 else ""))
                         for g, n in short.items()]
            st.waiting = f"{MEMORY_WAIT}: needs " + ", ".join(
                f"{needs} ({free})" for needs, free in shortfall) + (f"; {again}" if again else "")
            if not wait:
                return Outcome(False, st.waiting)
            short_since = st.short_since = clock.now() if short_since is None else short_since
            moved = await self.move(st, op, held, need, want, short, short_since, shown)
            if moved is not None:
                return moved
            if not announced:
                announced = True
                # the event's reason has no parentheses (the lab's toast adds its own) and
                # does not repeat "waiting for memory" (the toast says it waits)
                why = "needs " + "; ".join(f"{needs}, {free}" for needs, free in shortfall)
                self.c.announce(st.kernel_id, "restore_waiting", method=st.method,
                              bytes=sum(want.values()), reason=why, trigger=op.trigger)
                await shown(f"gpushare: {st.waiting}; the cell runs once memory frees "
                            "(interrupt to stop waiting)")
            if await self.make_room(st, want, free):
                delay = WAIT_BACKOFF[0]
                continue  # room was made: look at once (its end's wake-up came while we waited on it)
            freed = self.c.freed
            try:
                await asyncio.wait_for(freed.wait(), self.until_move(delay, short_since))
                delay = WAIT_BACKOFF[0]
            except asyncio.TimeoutError:
                delay = min(delay * 2, WAIT_BACKOFF[1])

    async def check(self, want: dict[int, int], strict: set[int], careful: frozenset[int] | set[int] = frozenset()
                    ) -> tuple[dict[int, int | None], dict[int, int | None], dict[int, int]]:
        """Free memory of ``want``'s GPUs read now, the room a restore has there, and the GPUs
        that lack it. ``strict``: GPUs without a turn across servers, where the room must
        hold twice and still be there a moment later. ``careful``: GPUs without a turn whose
        restore settles for room for once: after a random pause, seen three times."""
        free = await self.c.node_room.read_free(list(want))
        room = self.room_of(free)
        short = lacking(want, room, strict=strict)
        if short or not (strict or careful):
            return free, room, short
        if careful:  # another server settling at the same moment pauses for a different time
            await asyncio.sleep(random.uniform(0, TURNLESS_PAUSE))
        for _ in range(2 if careful else 1):  # the room must still be there a moment later
            await asyncio.sleep(STRICT_SETTLE)
            again = await self.c.node_room.read_free(sorted(strict | careful))
            room.update(self.room_of(again))
            short = lacking(want, room, strict=strict)
            if short:
                break
        return free, room, short

    def room_of(self, free: dict[int, int | None]) -> dict[int, int | None]:
        """A restore's room per GPU from free memory read now: less what releases in flight
        may take back there (None where free memory is unknown)."""
        return {g: None if f is None else f - self.releases_may_take_back(g) for g, f in free.items()}

    @property
    def turnless_after(self) -> float:
        """How long a restore without a turn waits for room for twice its state while it has
        room for once (the server's ``turnless_restore_after``; 0: for ever)."""
        return float(getattr(self.c.config, "turnless_restore_after", TURNLESS_AFTER))

    def settles_for_once(self, twice_since: float | None) -> bool:
        """Whether a restore without a turn, with room for its state once since
        ``twice_since``, has waited ``turnless_restore_after`` for twice and now takes once."""
        return (self.turnless_after > 0 and twice_since is not None
                and clock.now() - twice_since >= self.turnless_after)

    def until_move(self, delay: float, short_since: float | None) -> float:
        """How long to wait for freed memory before looking again: ``delay``, or less when
        the moment to restore onto other GPUs comes first."""
        after = self.c.move_after
        if after <= 0 or short_since is None:
            return delay
        return max(0.05, min(delay, short_since + after - clock.now()))

    async def move(
        self, st: Lifecycle, op: Operation, held: Held, need: dict[int, int],
        want: dict[int, int], short: dict[int, int], short_since: float, shown: CellProgress,
    ) -> Grant | None:
        """Restore onto other GPUs, once the kernel's own have lacked room for ``move_after``
        seconds and others have it: a grant whose ``mapping`` says where each GPU's state
        goes, with its turns taken and its bytes reserved there. None: not now (too early,
        the method cannot move, nowhere has room, or part of the state is still on the GPU)."""
        after = self.c.move_after
        if after <= 0 or clock.now() - short_since < after or want != need:
            return None
        refusal = self.refusal(held)
        if refusal:
            if st.waiting and "not moved" not in st.waiting:
                st.waiting += f"; not moved onto another GPU: {refusal}"
            return None
        views = await self.views(st, op, want)
        if views is None:
            return None
        plan = restore_target(want, views, lacking=short, keep=self.floor())
        if not plan:
            return None
        return await self.onto(st, op, held, want, plan, _why(plan, short, views), shown)

    async def off_home(self, st: Lifecycle, op: Operation, held: Held,
                       need: dict[int, int], shown: CellProgress) -> tuple[Grant | None, str]:
        """A home GPU whose SMs are contended (two kernels or more computing there, busy):
        a grant onto a quieter GPU with room, at once; or a home with room that the restore
        would leave below the pressure threshold (tight): a grant onto a GPU that keeps it and
        is no busier. None and why the kernel stays there ("" when home is neither, or
        nowhere fits)."""
        if self.c.move_after <= 0 or UNKNOWN_GPU in need or not need:
            return None, ""
        home = self.load.views({g: None for g in need}, exclude=st.kernel_id)
        busy = sorted(g for g, v in home.items() if contended(v))
        refusal = self.refusal(held)
        tight: dict[int, int] = {}
        if not busy:
            if refusal:  # it stays home, as it would have: nothing to say, nothing to read
                return None, ""
            tight = await self.tight_home(need)
            if not tight:
                return None, ""
        elif refusal:
            return None, f"on {_gpus(busy)}, which {'is' if len(busy) == 1 else 'are'} busy; " \
                         f"not moved: {refusal}"
        views = await self.views(st, op, need)
        if views is None:
            return None, ""
        for g, room in tight.items():  # the check's room at home: the rule weighs the threshold
            views[g] = replace(views[g], room=room)
        plan = restore_target(need, views, keep=self.floor())
        if not plan:
            return None, ""
        why = _why(plan, {}, views, tight=tight, floor=self.c.config.pressure_free_fraction)
        return await self.onto(st, op, held, need, plan, why, shown), ""

    async def tight_home(self, need: dict[int, int]) -> dict[int, int]:
        """The home GPUs where the restore has room (as its check counts it) but would leave
        less free than the pressure threshold, with that room; {} unless every home GPU has
        room (a home without it waits, then moves after ``move_after``)."""
        floor = self.floor()
        if not any(floor.values()):
            return {}
        try:
            free = await self.c.node_room.read_free(list(need))
        except Exception as e:  # the check reads again, and says so
            log.debug("gpushare: cannot read free GPU memory: %s", e)
            return {}
        room = self.room_of(free)
        if any(room.get(g) is None or room[g] < n for g, n in need.items()):  # type: ignore[operator]
            return {}
        return {g: r for g, n in need.items() if (r := room[g]) is not None
                and r - n < floor.get(g, 0)}

    def floor(self) -> dict[int, int]:
        """Bytes a move should leave free on each GPU: the pressure threshold (below it, the
        GPU's idle kernels would be released for the move)."""
        return pressure_floor(self.c.node_room.total_bytes(),
                              self.c.config.pressure_free_fraction)

    def refusal(self, held: Held) -> str | None:
        """Why the held state's method cannot restore onto other GPUs (None: it can)."""
        method = self.c.methods.get(held.method)
        return method.move_refusal() if method is not None \
            else f"the {held.method} method is not available"

    async def views(self, st: Lifecycle, op: Operation, want: dict[int, int]
                    ) -> dict[int, GpuView] | None:
        """Every GPU as the placement rule judges it for a restore of ``want``: room = free
        memory read now less restores' reservations, what releases in flight may take back
        and what this server's other released kernels will take back there (a GPU their
        memory left is their room, as placement and the rebalancer count it), narrowed by
        the hub service's view (none where the person is over their share, or where this
        server cannot read it); the home GPUs' room is the check's to judge. An ahead
        restore leaves out GPUs a cell's restore waits for. None: unreadable."""
        every = sorted(self.c.node_room.total_bytes())
        try:
            free = await self.c.node_room.read_free(every)
        except Exception as e:
            log.warning("gpushare: cannot read free GPU memory: %s", e)
            return None
        back = self.others_coming_back(st)
        others = self.c.placed_elsewhere()  # other servers' placed kernels, as placement counts
        room = {g: None if f is None else f - self.c.reservations.reserved(g)
                - self.releases_may_take_back(g) - back.get(g, 0) - others.get(g, 0)
                for g, f in free.items()}
        # the node-wide view narrows the targets; none where the person is over their share
        # (a GPU this server cannot read stays out, whatever the service reads there)
        unread = {g for g, f in room.items() if f is None}
        within = narrow(room, await self.c.node_room.node_view(every), keep=want)
        room.update({g: None for g, ok in within.items() if not ok or g in unread})
        if op.trigger == ahead.AHEAD:
            room.update({g: None for g in ahead.cells_wait_for(self.c, st) - set(want)})
        room.update({g: None for g in want})
        return self.load.views(room, exclude=st.kernel_id, others_pending={
            g: n * PENDING_LOAD for g, n in self.c.pending_elsewhere().items()})

    async def onto(self, st: Lifecycle, op: Operation, held: Held, want: dict[int, int],
                   plan: dict[int, int], why: str, shown: CellProgress) -> Grant | None:
        """The turns and room of ``plan``'s GPUs for ``want`` (a grant with the mapping and
        why), or None when they are taken meanwhile."""
        moved_want = {plan.get(g, g): n for g, n in want.items()}
        grant = await self.take_turn(st, moved_want, shown)
        try:
            _, _, still_short = await self.check(moved_want, set(grant.unguarded) & set(moved_want))
        except asyncio.CancelledError:
            grant.release()
            raise
        except Exception as e:
            log.warning("gpushare: cannot read free GPU memory: %s", e)
            still_short = moved_want
        if still_short or op.stopped or st.held is not held:
            grant.release()  # taken meanwhile, or stopped: the loop looks again
            return None
        grant.reserve(moved_want, self.c.holds(st.kernel_id, held.kernel_pid))
        grant.mapping = plan
        grant.why = why
        self.load.moved(st.kernel_id, plan)
        st.waiting = None
        return grant

    async def take_turn(self, st: Lifecycle, need: dict[int, int], shown: CellProgress) -> Grant:
        """The restore turn of every GPU in ``need``. While another server holds one, the
        cell's progress line and ``status`` say so (``waiting``)."""
        said = asyncio.Event()

        def on_turn_wait(gpu: int, holder: int | None, left: float) -> None:
            by = f" (process {holder})" if holder else ""
            st.waiting = (f"waiting for another server's restore turn on GPU {gpu}{by}, "
                          f"at most {left:.0f} s more")
            said.set()

        task = asyncio.ensure_future(self.c.reservations.acquire(list(need), on_turn_wait))
        heard = asyncio.ensure_future(said.wait())
        try:
            while not task.done():
                await asyncio.wait({task, heard}, return_when=asyncio.FIRST_COMPLETED)
                if heard.done() and not task.done():
                    said.clear()
                    heard = asyncio.ensure_future(said.wait())
                    await shown(f"gpushare: {st.waiting} (interrupt to stop waiting)")
        except asyncio.CancelledError:
            task.cancel()
            try:
                (await task).release()  # it had finished: give its locks back
            except BaseException:
                pass
            raise
        finally:
            heard.cancel()
        grant = task.result()
        try:
            for g, why in (await self.uncovered(need)).items():
                grant.unguarded.setdefault(g, why)
        except BaseException:
            grant.release()
            raise
        return grant

    async def uncovered(self, need: dict[int, int]) -> dict[int, str]:
        """``need``'s GPUs where this server's restore turns do not cover every party, with
        why: the turns come from a lock directory only this user's servers use (not root's),
        and a process that is none of this server's kernels is on the GPU. Another user's
        restore takes no turn with ours there, so such a GPU gets the check of a restore
        without a turn. This user's other servers' kernels count as others too (a stricter
        check for them, never a wrong one); per-process readings, not Unix users, because a
        server cannot always tell a process's user (containers) but always knows its kernels."""
        locks = self.c.reservations.node_locks
        gpus = {g for g in need if g >= 0}
        if locks is None or not gpus or locks.covers_every_user():
            return {}
        tracker = self.c.tracker
        ours = {p for rec in list(tracker.kernels.values()) for p in rec.pids}
        try:
            usage = await tracker.off_loop(tracker.telemetry.processes)
        except Exception as e:  # unknown: as if others were there (stricter, never wrong)
            log.warning("gpushare: cannot list the GPUs' processes: %s", e)
            others = set(gpus)
        else:
            others = {u.gpu for u in usage if u.gpu in gpus and u.pid not in ours}
        out = {}
        for g in sorted(others):
            out[g] = (f"other users' processes are on GPU {g} and this server's restore turns "
                      f"({locks.described()}) do not cover them")
            if g not in self._told_uncovered:
                self._told_uncovered.add(g)
                log.warning("gpushare: restores on GPU %s share it with other users' processes and "
                            "this server's restore turns do not cover them (turns: %s; they "
                            "cover %s only): such restores need room for twice "
                            "their state; set GPUShareApp.node_lock_dir to a root-owned directory "
                            "every server shares, or GPUShareApp.node_daemon_socket", g,
                            locks.described(), locks.reach())
        return out

    def others_coming_back(self, st: Lifecycle) -> dict[int, int]:
        """Per GPU, the held states of this server's other released kernels (each once: a
        release in flight counts in :meth:`releases_may_take_back`, a restore in flight in
        its reservation)."""
        return coming_back(o for o in self.c.lifecycles()
                           if o is not st and not (o.op is not None and o.op.kind == "release"))

    def releases_may_take_back(self, gpu: int) -> int:
        """Bytes that releases in flight may put back on ``gpu``: an undo re-allocates what the
        release freed, so those bytes are not free for a restore until the release has ended
        (a restore promised them would run out of memory mid-way: wedged)."""
        total = 0
        for other in self.c.states.values():
            if other.op is not None and other.op.kind == "release" and other.held is not None:
                total += other.held.gpus.get(gpu, 0) + other.held.gpus.get(-1, 0)
        return total

    async def still_to_land(self, st: Lifecycle, held: Held, need: dict[int, int]) -> dict[int, int]:
        """``need`` less what the kernel's process still holds on each GPU. A release that
        failed part-way (or before moving anything) left those bytes in place, and they count
        as used already: charging them again left such a kernel waiting for memory it does not
        need, for good on a busy GPU. Measured now, per process, never from an older poll: a
        count that lags behind bytes that did leave would make room that is not there."""
        if held.complete or not held.attributed:
            return need  # every byte left (the method said so), or not measured per process
        await self.c.refresh_quietly()
        rec = self.c.tracker.kernels.get(st.kernel_id)
        if rec is None or not rec.attributed or not rec.pids or rec.pids[0] != held.kernel_pid:
            return need  # not measured per process, or another process now: charge it all
        return {g: max(0, n - rec.gpu_bytes.get(g, 0)) for g, n in need.items()}

    async def make_room(self, st: Lifecycle, need: dict[int, int], free: dict[int, int | None]) -> bool:
        """Release idle kernels per policy; a victim whose release failed recently is skipped.
        True when some victim was released (a refused or failed one frees nothing: the caller
        backs off, or a victim refused again and again would be asked in a tight loop)."""
        made = False
        cands = self.room_candidates(st.kernel_id, clock.now())
        plan = self.c.rules.make_room(need, self.known_free(free), cands, exclude=st.kernel_id)
        for d in plan or []:
            try:
                victim_op = self.c.release_automatically(d.kernel_id, d.reason)
            except ControllerError as e:
                log.info("gpushare: could not make room with %s: %s", d.kernel_id, e.message)
                continue
            outcome = await wait_for(victim_op)
            if not outcome.ok:
                log.info("gpushare: could not make room with %s: %s", d.kernel_id, outcome.message)
            made = made or outcome.ok
        return made

    def room_candidates(self, exclude: str, now: float) -> list[Candidate]:
        """The kernels make-room may judge (a restore waiting for room, a cell that ran out
        of memory): this server's, none with an operation running or whose release failed
        recently, ``exclude`` (the kernel the room is for) left out."""
        cands = []
        for k, rec in self.c.tracker.kernels.items():
            other = self.c.states.get(k)
            if other is None or other.op is not None or k == exclude:
                continue
            if self.c.failed_recently(other, now):
                continue
            cands.append(self.c.candidate(other, rec, now))
        return cands

    def known_free(self, free: dict[int, int | None]) -> dict[int, int]:
        """Free bytes read now, as make-room counts them: less restores' reservations; GPUs
        whose free memory is unknown left out."""
        seen = {g: self.c.reservations.seen_free(g, f) for g, f in free.items()}
        return {g: f for g, f in seen.items() if f is not None}


def _gpus(gpus: list[int]) -> str:
    return ("GPU " if len(gpus) == 1 else "GPUs ") + ", ".join(map(str, gpus))


def _why(plan: dict[int, int], short: dict[int, int], views: dict[int, GpuView],
         tight: dict[int, int] | None = None, floor: float = 0.0) -> str:
    """Why a restore goes onto ``plan``'s GPUs, for a person: "GPU 0 busy (2 kernels
    computing, 97 % SM)", "GPU 0 had no room", "GPU 0 would be left under 10 % free"."""
    out = []
    for g in sorted(plan):
        v = views.get(g)
        if g in (tight or {}):
            out.append(f"GPU {g} would be left under {floor:.0%} free")
        elif g in short or v is None:
            out.append(f"GPU {g} had no room")
        else:
            out.append(f"GPU {g} busy ({v.busy} kernels computing, {v.load:.0f} % SM)")
    return "; ".join(out)


def _settling(grant: Grant, gpus: set[int], after: float) -> str:
    """The cell's line when a restore without a turn settles for room for once."""
    why = "; ".join(sorted({w for w in grant.unguarded.values() if w}))
    on = ", ".join(f"GPU {g}" for g in sorted(gpus))
    return (f"gpushare: no restore turn on {on}" + (f" ({why})" if why else "")
            + f"; room for twice the state did not come in {after:g} s: restoring with room "
            "for it once, seen three times")

