"""Fair shares of GPU memory: who is guaranteed how much, and who is over it. Pure.

An admin gives users or groups a guaranteed amount of GPU memory, per GPU or per node
(``GPUShareHub.shares``)::

    {"alice": "8GiB", "group:students": "25%", "group:research": "40GiB per node", "*": "2GiB"}

- a key is a user name, ``group:NAME``, or ``*`` (everyone without an entry of their own);
- a value is bytes (an int, or ``"8GiB"``, ``"512MiB"``, ``"1.5 GB"``), or a percentage of
  the GPU's memory (``"25%"``); per GPU unless it ends in ``per node`` (then it bounds the
  person's total on all GPUs of a node; a percentage is then of the node's memory).

A user's share is their own entry, else the most generous entry of their groups, else ``*``.
With no entry at all they are guaranteed nothing: any memory they hold is over their share.
With an empty table shares are off and nobody is over anything.

Caps (``GPUShareHub.caps``) sit next to shares, keyed the same way: the most one kernel of
the person may hold per GPU (``{"group:students": "8GiB", "*": "16GiB"}``); bytes only, no
percentages. A user's cap is their own entry, else the most generous of their groups', else
``*``, else none (:func:`cap_of`).

No I/O and no clock: the hub service and the simulator both use this module.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .caps import parse_cap

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_AMOUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?|%)\s*(?:(?:per|/)\s*(gpu|node))?\s*$",
                     re.IGNORECASE)
DEFAULT_KEY = "*"
GROUP_PREFIX = "group:"
UNBOUNDED = 1 << 62  # headroom when shares are off


@dataclass(frozen=True)
class Share:
    """One guarantee: ``amount`` bytes, or ``fraction`` of the memory, per GPU or per node."""

    per: str = "gpu"  # "gpu" | "node"
    amount: int | None = None
    fraction: float | None = None
    source: str = ""  # the table key it came from, for people to read ("group:students")

    def limit(self, total: int) -> int:
        """Guaranteed bytes where the GPU (or node) has ``total`` bytes."""
        if self.fraction is not None:
            return int(self.fraction * total)
        return self.amount or 0

    def describe(self) -> str:
        what = f"{self.fraction * 100:g} %" if self.fraction is not None else _fmt(self.amount or 0)
        return f"{what} per {self.per}"


def parse_share(value: object, source: str = "") -> Share:
    """``8589934592``, ``"8GiB"``, ``"25%"``, ``"40 GiB per node"`` -> Share; ValueError says why."""
    if isinstance(value, bool):
        raise ValueError(f"share {source!r}: {value!r} is not an amount of memory")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"share {source!r}: {value} bytes is negative")
        return Share("gpu", amount=value, source=source)
    if not isinstance(value, str):
        raise ValueError(f"share {source!r}: {value!r} is not an amount of memory")
    m = _AMOUNT.match(value)
    if m is None:
        raise ValueError(f'share {source!r}: {value!r} is not an amount like "8GiB", "25%" or '
                         '"40GiB per node"')
    number, unit, per = float(m.group(1)), m.group(2).lower(), (m.group(3) or "gpu").lower()
    if unit == "%":
        if not 0 <= number <= 100:
            raise ValueError(f"share {source!r}: {value!r} is not a percentage in 0-100")
        return Share(per, fraction=number / 100, source=source)
    if unit not in _UNITS:
        raise ValueError(f"share {source!r}: unknown unit in {value!r}")
    return Share(per, amount=int(number * _UNITS[unit]), source=source)


def parse_table(table: Mapping[str, object]) -> dict[str, Share]:
    """Check a whole ``shares`` table (keys and values); ValueError names the bad entry."""
    out = {}
    for key, value in table.items():
        if not isinstance(key, str) or not key.strip() or key == GROUP_PREFIX:
            raise ValueError(f"shares: {key!r} is not a user, group:NAME or *")
        out[key] = parse_share(value, key)
    return out


def shares_of(user: str, groups: Iterable[str], table: Mapping[str, Share]) -> list[Share]:
    """The entries that may apply to ``user``: their own; else their groups' (the most
    generous is taken where it is evaluated); else ``*``; else none."""
    if user in table:
        return [table[user]]
    found = [table[GROUP_PREFIX + g] for g in sorted(groups) if GROUP_PREFIX + g in table]
    if found:
        return found
    return [table[DEFAULT_KEY]] if DEFAULT_KEY in table else []


def parse_caps(table: Mapping[str, object]) -> dict[str, int]:
    """Check a whole ``caps`` table (keys as for shares, values amounts per GPU); ValueError
    names the bad entry."""
    out = {}
    for key, value in table.items():
        if not isinstance(key, str) or not key.strip() or key == GROUP_PREFIX:
            raise ValueError(f"caps: {key!r} is not a user, group:NAME or *")
        out[key] = parse_cap(value, f"cap {key!r}")
    return out


def cap_of(user: str, groups: Iterable[str], table: Mapping[str, int]) -> int | None:
    """Bytes per GPU one kernel of ``user`` may hold by the admin's table: their own entry,
    else the most generous of their groups', else ``*``; None: no cap."""
    if user in table:
        return table[user]
    found = [table[GROUP_PREFIX + g] for g in groups if GROUP_PREFIX + g in table]
    if found:
        return max(found)
    return table.get(DEFAULT_KEY)


@dataclass
class Ledger:
    """GPU memory each person holds now, and the shares that bound it.

    ``usage`` counts bytes resident on each GPU (released kernels hold none). GPUs are keyed
    by any hashable id the caller uses; ``node_of`` groups them into nodes."""

    gpu_total: dict[int, int]
    node_of: dict[int, str]
    usage: dict[str, dict[int, int]] = field(default_factory=dict)
    shares: dict[str, list[Share]] = field(default_factory=dict)
    enabled: bool = True  # False: no shares table; nobody is within or over anything

    def used(self, user: str, gpu: int) -> int:
        return self.usage.get(user, {}).get(gpu, 0)

    def node_used(self, user: str, node: str) -> int:
        return sum(n for g, n in self.usage.get(user, {}).items() if self.node_of.get(g) == node)

    def node_total(self, node: str) -> int:
        return sum(t for g, t in self.gpu_total.items() if self.node_of.get(g) == node)

    def guaranteed(self, user: str, gpu: int) -> tuple[int, int] | None:
        """(limit, used) of the user's most generous share that covers ``gpu``; None = no share."""
        best: tuple[int, int] | None = None
        for share in self.shares.get(user, []):
            if share.per == "node":
                node = self.node_of.get(gpu, "")
                pair = (share.limit(self.node_total(node)), self.node_used(user, node))
            else:
                pair = (share.limit(self.gpu_total.get(gpu, 0)), self.used(user, gpu))
            if best is None or pair[0] - pair[1] > best[0] - best[1]:
                best = pair
        return best

    def headroom(self, user: str, gpu: int) -> int:
        """Bytes the user may still add on ``gpu`` and stay within their share (< 0: over)."""
        if not self.enabled:
            return UNBOUNDED  # shares off: never over
        pair = self.guaranteed(user, gpu)
        if pair is None:
            return -self.used(user, gpu) if self.used(user, gpu) else 0
        limit, used = pair
        return limit - used

    def within(self, user: str, gpu: int, adding: int = 0) -> bool:
        """Holding ``adding`` more bytes on ``gpu`` keeps the user within their share."""
        return not self.enabled or adding <= self.headroom(user, gpu)

    def over(self, user: str, gpu: int) -> bool:
        """The user holds more than their share where ``gpu`` counts (false when shares are off)."""
        return self.enabled and self.headroom(user, gpu) < 0

    def take(self, user: str, gpu: int, nbytes: int) -> None:
        """Account a release of ``nbytes`` of the user's memory on ``gpu``."""
        per = self.usage.setdefault(user, {})
        per[gpu] = max(0, per.get(gpu, 0) - nbytes)


def _fmt(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
