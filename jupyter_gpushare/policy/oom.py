"""Room for the next try of a cell that ran out of GPU memory: which idle kernels to release.

Pure (no I/O, no clock): the server (``core.oom_room``) and the simulator call :func:`plan`
alike, through the server's policy object (a site's own ``make_room`` is honoured).
"""

from __future__ import annotations

from . import Candidate, Decision, Policy, may_take_for_room
from .placement import pressure_floor


def plan(rules: Policy, gpus: list[int], nbytes: int | None, free: dict[int, int],
         total: dict[int, int], candidates: list[Candidate], exclude: str,
         ) -> list[Decision] | None:
    """The kernels to release after ``exclude`` failed to allocate ``nbytes`` (None: not
    said) on each of ``gpus``: [] when the retry fits already, None when it cannot be made to
    fit. Pure: the server and the simulator call it alike. ``free``: bytes free per GPU
    (releases in flight counted as done); ``total``: each GPU's memory."""
    if nbytes is not None:
        floor = pressure_floor({g: total.get(g, 0) for g in gpus},
                               rules.settings.pressure_free_fraction)
        with_floor = rules.make_room({g: nbytes + floor[g] for g in gpus}, free, candidates, exclude)
        if with_floor is not None:
            return with_floor
        return rules.make_room({g: nbytes for g in gpus}, free, candidates, exclude)
    pool = {g: sum(c.gpu_bytes.get(g, 0) for c in candidates
                   if c.kernel_id != exclude and may_take_for_room(c, rules.settings)) for g in gpus}
    if not any(pool.values()):
        return None
    return rules.make_room({g: free.get(g, 0) + n for g, n in pool.items() if n},
                           free, candidates, exclude)
