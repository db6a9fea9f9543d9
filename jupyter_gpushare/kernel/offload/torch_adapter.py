"""PyTorch: move every device tensor reachable from the namespace to host memory, in place.

How: tensors are grouped by the storage they share. Each storage is copied once to (pinned)
host memory, then every tensor of the group is re-pointed at the host copy with its own
offset, sizes and strides, through ``tensor.data = ...`` (:func:`_set`; ``set_`` refuses a
storage of another device). Reload does the reverse with a fresh device storage. The Python
objects never change, so ``id()``, ``requires_grad``, ``.grad``, Parameter identity inside
optimizers, tied weights and views (all aliases of one storage follow together) survive.
The autograd version counters are kept as they were, so a graph built before the release
can still run ``backward`` after the reload. While released a tensor really is a host
tensor (``tensor.device`` is the CPU): the reload finds the tensors through the groups it
kept, never by their device.

Safety rule: a storage is moved only if every tensor using it was found. The storage's use
count (tensors plus one Python wrapper) proves it; when something outside the namespace also
uses it (an autograd graph that saved an output, a C++ structure, a compiled graph's
constant), moving the tensors we see would split the aliases, so the storage stays on the
device and is reported in ``skipped``. While offloaded, the tensors are ordinary host tensors:
code that touches one by mistake computes on the CPU or gets a device-mismatch error, it never
reads freed device memory.

All or nothing (:mod:`.txn`): every storage is copied first; re-pointing a batch of tensors
is undone completely if one refuses. On offload, a storage whose tensors refuse stays on the
device and is reported in ``skipped`` while the rest moves; a failed reload leaves every
tensor offloaded, ready for a retry.

Speed (:class:`StreamCopies`, the default): host copies go into page-locked buffers kept
from one cycle to the next (:class:`.pinned.PinnedPool`, bounded, see there for how that
host memory is counted), or, for a storage written since its kept copy (incremental releases),
into that copy's own buffer (:func:`_copy_to_host`, the release's and the pre-copy's one way);
every copy is issued on one side stream per GPU (which first waits for the work already
queued on the device), and each move ends with one synchronize per GPU, never one per
tensor: the GPUs' copies run at the same time, each at its bus's speed.

The copies are parametrised: ``copies`` (an object with :class:`StreamCopies`'s hooks) or,
the older seam, ``to_host`` / ``to_device`` / ``synchronize`` (fresh buffers each time, one
global synchronize), so tests run the very same logic between two CPU storages.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..walk import Child, Ref, walk_namespace
from . import quiet
from .base import (
    KEEP_HOST_COPY_ENV,
    OffloadAdapter,
    OffloadReport,
    drop_oldest,
    keep_host_copies,
    kept_check,
)
from .pinned import PinnedPool
from .txn import Change, UndoIncomplete, apply_all

if TYPE_CHECKING:  # torch is imported only when the adapter is used (it is then loaded already)
    import torch


def _torch() -> Any:
    import torch

    return torch


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over ``storage`` (tensor ``copy_`` works across every device pair)."""
    torch = _torch()
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def cuda_to_pinned(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """Default ``to_host``: an asynchronous copy into page-locked host memory."""
    torch = _torch()
    host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True)
    host.copy_(_byte_view(storage), non_blocking=True)
    return host.untyped_storage()


def pinned_to_cuda(host: torch.UntypedStorage, device: torch.device) -> torch.UntypedStorage:
    """Default ``to_device``: a fresh storage on ``device``, filled asynchronously."""
    torch = _torch()
    new = torch.empty(host.nbytes(), dtype=torch.uint8, device=device)
    new.copy_(_byte_view(host), non_blocking=True)
    return new.untyped_storage()


def _cuda_synchronize() -> None:
    torch = _torch()
    if torch.cuda.is_initialized():
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)


def _cuda_reserved() -> int:
    """Bytes the caching allocator holds on all GPUs; 0 without touching an unused CUDA."""
    torch = _torch()
    if not torch.cuda.is_initialized():
        return 0
    return sum(torch.cuda.memory_reserved(i) for i in range(torch.cuda.device_count()))


def _empty_caches() -> None:
    torch = _torch()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _release_pinned_cache() -> None:
    """Hand cached page-locked blocks back to the OS once the host copies are gone."""
    torch = _torch()
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_initialized():
        empty()


def _pinned_alloc(nbytes: int) -> torch.UntypedStorage:
    torch = _torch()
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()


def _storage_shared(storage: torch.UntypedStorage) -> bool:
    """Whether something besides the one Python wrapper holds ``storage`` (a view the user
    took of an offloaded tensor): such a buffer must never be overwritten by a later cycle."""
    return bool(_torch()._C._storage_Use_Count(storage._cdata) > 1)


# -- fingerprints: whether a storage's bytes changed, read on its own device -------------------
# A write through ``.data``, DLPack or a raw pointer moves no version counter, so a kept host
# copy is trusted only while the storage's fingerprint is the one taken with the copy. The
# fingerprint is sum(w[i] * word[i]) mod 2**64 over the storage's 32-bit words (the last
# bytes alone), each weight a random odd 64-bit number (column weight x row weight x chunk
# weight, drawn per process): any change to one word always changes it, and any other
# change leaves it equal with a probability below 2**-32. It reads the storage once at the
# device's memory bandwidth (a few temporaries of one chunk), far less than a copy over
# the bus.
_FP_COLUMNS = 4096  # 32-bit words per row
_FP_ROWS = 2048  # rows per chunk: 32 MiB of the storage at a time, a temporary of 64 MiB
_FP_BLOCK_ROWS = 256  # CPU: rows widened at a time (a reused buffer of 8 MiB)
_SAMPLE_ALL_BELOW = 1 << 20  # "sampled" check: storages up to 1 MiB are read whole
_SAMPLE_STRIDE = 1024  # "sampled" check: one 32-bit word per 4 KiB page
_FP_SEED = int.from_bytes(os.urandom(8), "little") >> 1
_SAMPLE_OFFSET = _FP_SEED % _SAMPLE_STRIDE  # which word of each 4 KiB, drawn per process
_fp_weights: dict[str, tuple[Any, Any]] = {}  # device -> (column weights, row weights)


def _odd_int64(n: int, seed: int) -> torch.Tensor:
    torch = _torch()
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 62), 1 << 62, (n,), dtype=torch.int64, generator=g) * 2 + 1


def _chunk_weight(index: int) -> int:
    """An odd signed 64-bit weight for chunk ``index`` (splitmix64 of the seed and index)."""
    z = (_FP_SEED + (index + 1) * 0x9E3779B97F4A7C15) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    z = (z ^ (z >> 31)) | 1
    return z - (1 << 64) if z >= 1 << 63 else z


def _weights(device: Any) -> tuple[Any, Any]:
    key = str(device)
    found = _fp_weights.get(key)
    if found is None:
        found = _fp_weights[key] = (_odd_int64(_FP_COLUMNS, _FP_SEED).to(device),
                                    _odd_int64(_FP_ROWS, _FP_SEED + 1).to(device))
    return found


def fingerprint(storage: torch.UntypedStorage) -> torch.Tensor:
    """The storage's fingerprint as a 0-d int64 tensor on its device, queued on the current
    stream (reading it waits for the work queued before)."""
    torch = _torch()
    data = _byte_view(storage)
    nwords = data.numel() // 4
    total = _words_fingerprint(data[:nwords * 4].view(torch.int32))
    tail = data[nwords * 4:]
    if tail.numel():
        cols, _ = _weights(data.device)
        total += (tail.to(torch.int64) * cols[:tail.numel()]).sum() * _chunk_weight(-2)
    return total


def sampled_fingerprint(storage: torch.UntypedStorage) -> torch.Tensor:
    """The fingerprint of a strided sample of the storage (``KEPT_CHECK_ENV`` = "sampled"):
    one 32-bit word per 4 KiB (at an offset drawn per process) of a storage over 1 MiB,
    every byte of a smaller one. A rewrite of a whole tensor changes it; a write that misses
    every sampled word does not."""
    torch = _torch()
    if storage.nbytes() <= _SAMPLE_ALL_BELOW:
        return fingerprint(storage)
    data = _byte_view(storage)
    words = data[:data.numel() // 4 * 4].view(torch.int32)
    return _words_fingerprint(words[_SAMPLE_OFFSET::_SAMPLE_STRIDE].contiguous())


def _words_fingerprint(words: torch.Tensor) -> torch.Tensor:
    """sum(w[i] * words[i]) mod 2**64 over a flat int32 tensor, chunk by chunk."""
    torch = _torch()
    cols, rows = _weights(words.device)
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    chunk = _FP_COLUMNS * _FP_ROWS
    buffer: list[Any] = []  # the CPU's widening buffer, reused across chunks
    for index, start in enumerate(range(0, words.numel(), chunk)):
        part = words[start:start + chunk]
        full = part.numel() // _FP_COLUMNS * _FP_COLUMNS
        rows_of = part[:full].view(-1, _FP_COLUMNS)
        if rows_of.device.type == "cpu":
            per_row = _cpu_row_sums(rows_of, cols, buffer)
        else:  # one pass less on a GPU: the widening happens inside the product
            per_row = (rows_of * cols).sum(dim=1)
        value = (per_row * rows[:per_row.numel()]).sum()
        if full < part.numel():  # the last row, short
            rest = part[full:]
            value += (rest * cols[:rest.numel()]).sum() * rows[per_row.numel()]
        total += value * _chunk_weight(index)
    return total


def _cpu_row_sums(rows_of: torch.Tensor, cols: torch.Tensor, buffer: list[Any]) -> torch.Tensor:
    """Each row's sum(cols * row) in int64, the GPU's product and sum, but widened a block of
    rows at a time into one reused buffer and summed by a matrix-vector product: on a CPU,
    fresh temporaries the size of the data (new pages each) cost more than the arithmetic."""
    torch = _torch()
    n = rows_of.shape[0]
    out = torch.empty(n, dtype=torch.int64)
    if not n:
        return out
    if not buffer:
        buffer.append(torch.empty(min(n, _FP_BLOCK_ROWS), _FP_COLUMNS, dtype=torch.int64))
    block_rows = buffer[0].shape[0]
    for start in range(0, n, block_rows):
        block = rows_of[start:start + block_rows]
        wide = buffer[0][:block.shape[0]]
        wide.copy_(block)
        torch.mv(wide, cols, out=out[start:start + block.shape[0]])
    return out


#: the fingerprint each kind of check takes ("counters" takes none)
_FINGERPRINTS: dict[str, Callable[[Any], Any]] = {"full": fingerprint,
                                                  "sampled": sampled_fingerprint}


def _read_fingerprints(values: list[Any]) -> list[int]:
    """The values of queued fingerprints: one wait and one small copy per device."""
    torch = _torch()
    by_device: dict[str, list[int]] = {}
    for i, v in enumerate(values):
        by_device.setdefault(str(v.device), []).append(i)
    out = [0] * len(values)
    for indices in by_device.values():
        for i, v in zip(indices, torch.stack([values[i] for i in indices]).tolist(), strict=True):
            out[i] = int(v)
    return out


_default_pool: PinnedPool | None = None


def default_pool() -> PinnedPool:
    """The kernel process's pool of pinned buffers for PyTorch (adapters are made anew for
    each release; the buffers outlive them)."""
    global _default_pool
    if _default_pool is None:
        _default_pool = PinnedPool(_pinned_alloc, shared=_storage_shared)
    return _default_pool


class StreamCopies:
    """How bytes move, the fast way: pooled page-locked host buffers, copies issued on one
    stream per device, one synchronize per device at the end of a move.

    The hooks (all optional; defaults are CUDA's) are the seam the CPU tests drive:
    ``alloc_device(nbytes, device)`` a new device storage; ``copy(dst, src, device)`` an
    asynchronous copy on ``device``'s copy stream (the first one of a move per device also
    makes that stream wait for the work queued on the device: the copy must see what the
    last cell wrote, and must not write memory a queued kernel still uses);
    ``sync(device)`` waits for ``device``'s copy stream. ``pool`` hands out host buffers."""

    def __init__(self, *, pool: PinnedPool | None = None,
                 alloc_device: Callable[[int, Any], Any] | None = None,
                 copy: Callable[[Any, Any, Any], None] | None = None,
                 sync: Callable[[Any], None] | None = None) -> None:
        self.pool = pool if pool is not None else default_pool()
        self.alloc_device = alloc_device or _cuda_alloc
        self.copy = copy or self._cuda_copy
        self.sync = sync or self._cuda_sync
        self._joined: set[Any] = set()  # devices whose copy stream waited this move
        self.background = False  # a pre-copy's: streams of their own, at the lowest priority

    def for_background(self) -> StreamCopies:
        """The same pool and hooks, for a pre-copy while cells run: its own copy stream per
        GPU at the lowest priority (0: cells' streams come first), never the release's."""
        other = StreamCopies(pool=self.pool, alloc_device=self.alloc_device)
        other.copy = self.copy if self.copy != self._cuda_copy else other._cuda_copy
        other.sync = self.sync if self.sync != self._cuda_sync else other._cuda_sync
        other.background = True
        return other

    # -- the move, as the adapter uses it ------------------------------------------------
    def to_host(self, storage: Any, device: Any) -> Any:
        host = self.pool.take(storage.nbytes())
        try:
            self.copy(host, storage, device)
        except BaseException:
            self.pool.give(host, storage.nbytes())  # nothing was queued into it
            raise
        return host

    def into(self, host: Any, storage: Any, device: Any) -> Any:
        """Copy ``storage`` into ``host``, a buffer of its size that the caller owns (a kept
        copy's, no longer trusted): nothing allocated, nothing pinned."""
        self.copy(host, storage, device)
        return host

    def to_device(self, host: Any, device: Any) -> Any:
        new = self.alloc_device(host.nbytes(), device)
        self.copy(new, host, device)
        return new

    def fingerprint(self, storage: Any, device: Any, check: str = "full") -> Any:
        """``storage``'s fingerprint (``check``: "full" or "sampled"), queued where this
        move's copies go (a pre-copy's: its own stream, after the work queued on the device),
        so that it reads what the copy queued next reads; its value is read after
        :meth:`synchronize`."""
        if self.copy != self._cuda_copy:  # the test hooks: storages in host memory
            return _FINGERPRINTS[check](storage)
        with _torch().cuda.stream(self._joined_stream(device)):
            return _FINGERPRINTS[check](storage)

    def synchronize(self, devices: Iterable[Any]) -> None:
        """One wait per device (every device's copies were queued before the first wait, so
        they ran at the same time); each device is waited for even if another fails."""
        error: BaseException | None = None
        for device in dict.fromkeys(devices):
            try:
                self.sync(device)
            except BaseException as exc:
                error = error or exc
            self._joined.discard(device)
        if error is not None:
            raise error

    def recycle(self, host: Any) -> None:
        """A host copy no longer in use: kept for the next cycle when the bounds allow."""
        self.pool.give(host, host.nbytes())

    def settle(self) -> None:
        """Wait for every stream of every GPU (work a cell queued on a stream of its own may
        still write after the cell ended): a pre-copy's copies are then current as of the
        epoch read after it (the test hooks: nothing runs behind them)."""
        if self.copy == self._cuda_copy:
            _cuda_synchronize()

    def end_cycle(self) -> None:
        if self.pool.end_cycle():
            _release_pinned_cache()  # the dropped buffers go back to the OS, not a cache

    # -- CUDA -----------------------------------------------------------------------------
    def _stream(self, device: Any) -> Any:
        key = (_stream_key(device), self.background)
        stream = _streams.get(key)
        if stream is None:  # priority 0 is CUDA's lowest: a pre-copy yields to the cells
            stream = _streams[key] = _torch().cuda.Stream(device=device, priority=0)
        return stream

    def _joined_stream(self, device: Any) -> Any:
        """The copy stream of ``device``, after the work queued on the device so far. A
        pre-copy waits before every copy: the cells keep queueing work, and a copy must see
        every write that its version counters (read just before) count."""
        torch = _torch()
        stream = self._stream(device)
        if device not in self._joined or self.background:
            stream.wait_stream(torch.cuda.current_stream(device))
            self._joined.add(device)
        return stream

    def _cuda_copy(self, dst: Any, src: Any, device: Any) -> None:
        with _torch().cuda.stream(self._joined_stream(device)):
            _byte_view(dst).copy_(_byte_view(src), non_blocking=True)

    def _cuda_sync(self, device: Any) -> None:
        self._stream(device).synchronize()


#: one copy stream per GPU for the kernel process (streams are cheap but not free to make)
_streams: dict[Any, Any] = {}


def _stream_key(device: Any) -> Any:
    index = getattr(device, "index", None)
    return index if index is not None else str(device)


def _cuda_alloc(nbytes: int, device: Any) -> torch.UntypedStorage:
    """A new device storage, allocated for the device's current stream (the one cells use),
    so the caching allocator gives it back to that stream's pool when it is freed."""
    torch = _torch()
    return torch.empty(nbytes, dtype=torch.uint8, device=device).untyped_storage()


class LegacyCopies:
    """The older seam: ``to_host(storage)`` / ``to_device(host, device)`` make a new buffer
    each time, ``synchronize()`` waits for everything; nothing is kept across cycles."""

    def __init__(self, to_host: Callable[[Any], Any], to_device: Callable[[Any, Any], Any],
                 synchronize: Callable[[], None]) -> None:
        self._to_host, self._to_device, self._synchronize = to_host, to_device, synchronize

    def to_host(self, storage: Any, device: Any) -> Any:
        return self._to_host(storage)

    def into(self, host: Any, storage: Any, device: Any) -> Any:
        return self._to_host(storage)  # this seam makes a new buffer every time

    def to_device(self, host: Any, device: Any) -> Any:
        return self._to_device(host, device)

    def fingerprint(self, storage: Any, device: Any, check: str = "full") -> Any:
        return _FINGERPRINTS[check](storage)

    def synchronize(self, devices: Iterable[Any]) -> None:
        self._synchronize()

    def recycle(self, host: Any) -> None:
        pass

    def settle(self) -> None:
        self._synchronize()

    def end_cycle(self) -> None:
        _release_pinned_cache()

    def for_background(self) -> LegacyCopies:
        return self


def tensor_children(tensor: Any) -> Iterable[Child]:
    """What a tensor leads to: its gradient, the base of a view, Python attributes, and the
    inner tensors of wrapper subclasses (``__tensor_flatten__``, e.g. DTensor)."""
    # .grad of a non-leaf warns (and is None) unless it called retain_grad()
    grad = tensor.grad if tensor.is_leaf or tensor.retains_grad else None
    if grad is not None:
        yield ".grad", grad, Ref(tensor, "grad", "fixed")
    if tensor._base is not None:
        yield "._base", tensor._base, Ref(tensor, "_base", "fixed")
    attrs = getattr(tensor, "__dict__", None)
    if attrs:
        for key, value in list(attrs.items()):
            yield f".{key}", value, Ref(tensor, key, "attr")
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is not None:
        inner_names, _ = flatten(tensor)
        for name in inner_names:
            yield f".{name}", getattr(tensor, name), Ref(tensor, name, "fixed")


@dataclass
class _Group:
    """Tensors sharing one storage, and where their bytes live while offloaded."""

    device: Any  # torch.device the storage came from
    nbytes: int
    tensors: list[Any] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    host: Any = None  # torch.UntypedStorage while offloaded
    kept: _Kept | None = None  # the kept copy ``host`` came from (nothing was copied)


# a kept copy is used only while provably current (PyTorch: version counters and a device
# fingerprint; JAX: the very array alive); the switch is the base's
KEEP_ENV = KEEP_HOST_COPY_ENV


@dataclass
class _Kept:
    """A host copy kept while the kernel is resident, and what it was a copy of: the device
    storage (a weak reference: the copy never keeps device memory alive), every tensor of
    its group (weak) and their version counters at the moment of the copy.

    It is current while the storage lives at the same address and size, the same tensors
    (no more, no fewer) use it, and none of their version counters moved: every in-place
    write through PyTorch bumps the counter of the tensor written (a view shares its
    base's). Writes PyTorch does not see (through ``.data``, DLPack, NumPy, a raw pointer)
    move no counter: a release also checks the storage's device fingerprint (``check``:
    every byte, or a sample; see ``KEPT_CHECK_ENV``) against the one taken with the copy
    (:func:`_unchanged`), and copies the storage again when it differs, unless no code can
    have run since the copy was made current (``epoch``, :mod:`.quiet`)."""

    host: Any
    nbytes: int
    device: Any
    storage: Any  # torch.multiprocessing.reductions.StorageWeakRef
    tensors: list[weakref.ref]
    versions: list[int | None]  # None: an inference tensor, which has no counter
    fingerprint: int | None = None  # of the bytes copied (None: not known)
    #: the check ``fingerprint`` was taken for ("counters": none taken); a copy is trusted
    #: only under the check it was taken for
    check: str = "full"
    data_ptr: int = 0  # the storage's address at the copy
    at: float = field(default_factory=time.monotonic)
    #: the agent's epoch (:mod:`.quiet`) at which the copy was last known current: while it
    #: is still the epoch, no code ran that could have written the storage (None: not known)
    epoch: int | None = None

    def current(self, tensors: list[Any] | None = None) -> bool:
        if self.storage.expired():
            return False
        alive = [ref() for ref in self.tensors]
        if any(t is None for t in alive) or None in self.versions:
            return False
        if tensors is not None and {id(t) for t in tensors} != {id(t) for t in alive}:
            return False
        if not all(t.untyped_storage()._cdata == self.storage.cdata and t._version == v
                   for t, v in zip(alive, self.versions, strict=True)):
            return False
        storage = alive[0].untyped_storage() if alive else None  # resized: a new address
        return storage is not None and (storage.data_ptr(), storage.nbytes()) == (
            self.data_ptr, self.nbytes)


def _versions(tensors: list[Any]) -> list[int | None]:
    return [None if t.is_inference() else t._version for t in tensors]


def _weak_storage(storage: Any) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(storage)


#: device storage (``_cdata``) -> its kept host copy; process-wide, as the pool (adapters are
#: made anew for each release). Touched by the release, the restore and the pre-copy thread,
#: which never run at once (the agent stops the pre-copy first), and by reports: the lock.
_kept: dict[int, _Kept] = {}
_kept_lock = threading.RLock()


def _kept_entry(group: _Group, storage: Any, host: Any, print_: int | None,
                check: str, epoch: int | None = None) -> _Kept:
    return _Kept(host, group.nbytes, group.device, _weak_storage(storage),
                 [weakref.ref(t) for t in group.tensors], _versions(group.tensors), print_,
                 check, storage.data_ptr(), epoch=epoch)


def _same_epoch(began: int | None) -> int | None:
    """The epoch a copy made since ``began`` (the agent's epoch read before it read any
    byte) is current at: ``began`` if no request ran meanwhile and nothing else can run
    code now, else None (its next use checks it)."""
    return began if began is not None and quiet.epoch() == began else None


def _unchanged(candidates: list[tuple[_Kept, Any]], copies: Any, check: str,
               epoch: int | None = None, report: OffloadReport | None = None) -> set[int]:
    """Of (kept copy, device storage) pairs whose version counters say unchanged, the
    storages (``_cdata``) whose kept copy is current: made current at ``epoch``, the
    agent's epoch now (no code ran since that could have written it, :mod:`.quiet`), or
    passing ``check`` (:func:`.base.kept_check`): its fingerprint now is the copy's, or,
    under "counters", nothing more. A copy taken under another check, or a fingerprint that
    cannot be taken (no room for its temporaries), counts as changed: the storage is copied.
    ``report`` counts the bytes trusted by the epoch and those fingerprinted."""
    quiet_since = [(entry, storage) for entry, storage in candidates
                   if epoch is not None and entry.epoch == epoch]
    trusted = {storage._cdata for _, storage in quiet_since}
    if report is not None:
        report.trusted += sum(entry.nbytes for entry, _ in quiet_since)
    candidates = [(entry, storage) for entry, storage in candidates
                  if storage._cdata not in trusted and entry.check == check
                  and (check == "counters" or entry.fingerprint is not None)]
    if not candidates or check == "counters":
        return trusted | {storage._cdata for _, storage in candidates}
    try:
        queued = [copies.fingerprint(storage, entry.device, check)
                  for entry, storage in candidates]
        # they run on the copy streams, which the stream that reads them does not wait for:
        # read before they ran, a fingerprint's memory may still hold the last one taken
        # there (the allocator hands the block back), the kept copy's, and a write is lost
        copies.synchronize(entry.device for entry, _ in candidates)
        now = _read_fingerprints(queued)
    except Exception:
        return trusted
    if report is not None:
        report.checked += sum(entry.nbytes for entry, _ in candidates)
    return trusted | {storage._cdata for (entry, storage), value
                      in zip(candidates, now, strict=True) if entry.fingerprint == value}


def _copy_to_host(copies: Any, group: _Group, storage: Any) -> Any:
    """Queue a host copy of ``storage`` (a release's or a pre-copy's) and return its buffer:
    the buffer of the storage's kept copy when it fits (same size, nothing else uses it), so
    a changed storage pins no new host memory; else one from the pool.

    The kept copy stops being one before the copy into its buffer starts: a copy that fails
    halfway leaves nothing a later release could take for current (a write undone behind
    the counters would make the old fingerprint match half-overwritten bytes). A buffer whose
    copy failed is let go, never reused: the copy may still be writing it."""
    with _kept_lock:
        old = _kept.pop(storage._cdata, None)
    if old is None:
        return copies.to_host(storage, group.device)
    host = old.host
    del old
    if host.nbytes() != group.nbytes or _storage_shared(host):
        copies.recycle(host)  # resized, or a view of it is held: the pool decides
        del host
        return copies.to_host(storage, group.device)
    return copies.into(host, storage, group.device)


def kept_copies() -> dict[str, int]:
    """The kept host copies now (see :meth:`TorchAdapter.host_copies`), without a walk;
    "current" by their version counters (the fingerprints are read at release only)."""
    with _kept_lock:
        entries = list(_kept.values())
    current = sum(e.nbytes for e in entries if e.current())
    return {"current": current, "kept": sum(e.nbytes for e in entries)}


def reused_bytes() -> int:
    """Bytes of storages written since their kept copy that a release copies into that
    copy's own buffer (:func:`_copy_to_host`): copied, but into no new host memory."""
    with _kept_lock:
        entries = list(_kept.values())
    return sum(e.nbytes for e in entries if not e.current() and _reusable(e))


def _reusable(entry: _Kept) -> bool:
    """Whether a release would copy the entry's storage into the entry's own buffer."""
    alive = [ref() for ref in entry.tensors]
    storage = next((t.untyped_storage() for t in alive if t is not None), None)
    return (storage is not None and not entry.storage.expired()
            and storage._cdata == entry.storage.cdata and storage.nbytes() == entry.nbytes
            and entry.host.nbytes() == entry.nbytes and not _storage_shared(entry.host))


def drop_kept(wanted: int | None = None) -> int:
    """Free kept host copies, oldest first, until ``wanted`` bytes are freed (None: all)."""
    freed = drop_oldest(_kept, _kept_lock, wanted)
    if freed:
        _release_pinned_cache()
    return freed


class TorchAdapter(OffloadAdapter):
    module = "torch"
    name = "torch"

    def __init__(
        self,
        *,
        is_device: Callable[[Any], bool] | None = None,
        device_of: Callable[[Any], Any] | None = None,
        copies: StreamCopies | LegacyCopies | None = None,
        to_host: Callable[[Any], Any] | None = None,
        to_device: Callable[[Any, Any], Any] | None = None,
        synchronize: Callable[[], None] | None = None,
        max_depth: int = 100,
        max_objects: int = 1_000_000,
    ) -> None:
        """Defaults move CUDA tensors to pooled pinned host memory and back on one copy
        stream per GPU (:class:`StreamCopies`).

        is_device(tensor) -> bool: which tensors live on "the device".
        device_of(storage) -> the device it lives on (default ``storage.device``).
        copies: how bytes move (:class:`StreamCopies` with test hooks, or another object
        with the same methods).
        The older seam, used when ``to_host`` or ``to_device`` is given (:class:`LegacyCopies`):
        to_host(storage) -> host storage with the same bytes (may be asynchronous);
        to_device(host storage, device) -> new device storage with the same bytes;
        synchronize(): waits for the asynchronous copies.
        """
        self.is_device = is_device or (lambda t: t.is_cuda)
        self.device_of = device_of or (lambda storage: storage.device)
        if to_host is not None or to_device is not None:
            copies = LegacyCopies(to_host or cuda_to_pinned, to_device or pinned_to_cuda,
                                  synchronize or _cuda_synchronize)
        self.copies = copies if copies is not None else StreamCopies()
        self.walk_options = {"max_depth": max_depth, "max_objects": max_objects}
        self._groups: list[_Group] = []

    @property
    def offloaded(self) -> bool:
        return bool(self._groups)

    # -- the interface ------------------------------------------------------------------

    def device_bytes(self) -> int:
        return _cuda_reserved()

    def trim(self) -> int:
        """Empty the device caches; also frees the kept pinned buffers and host copies (host
        memory a driver checkpoint needs room in). Returns the device bytes freed."""
        before = _cuda_reserved()
        _empty_caches()
        drop_kept()
        pool = getattr(self.copies, "pool", None)
        if pool is not None and pool.clear():
            _release_pinned_cache()
        return max(0, before - _cuda_reserved())

    def host_copies(self) -> dict[str, int]:
        kept = kept_copies()
        reused = reused_bytes()
        to_copy = max(0, self.allocated_bytes() - kept["current"])
        return {**kept, "to_copy": to_copy, "to_copy_new": max(0, to_copy - reused)}

    def drop_host_copies(self, wanted: int | None = None) -> int:
        return drop_kept(wanted)

    def precopy(self, namespace: dict[str, Any], stop: Any = None) -> OffloadReport:
        """Copy to host, while cells may run, every storage whose kept copy is not current.

        On a thread of the agent, on each GPU's low-priority pre-copy stream (which first
        waits for the work queued by then). Each copy counts as of the version counters read
        before it was queued: a cell that writes a tensor meanwhile moves its counter, so its
        copy is stale and the release copies it again. ``stop`` set: no further copy is
        queued; those queued are waited for and kept."""
        report = OffloadReport(framework=self.name)
        if self._groups:
            return report  # offloaded: nothing is on the device
        start = time.perf_counter()
        copies = self.copies.for_background()
        settle = getattr(copies, "settle", None)
        if settle is not None and quiet.epoch() is not None:  # trusted by the epoch: no GPU
            settle()  # work may run behind the copies
        began = quiet.epoch()  # before any byte is read
        check = kept_check()
        groups = self._find_groups(namespace, report)
        with _kept_lock:
            counted = [(entry, storage) for group, storage in groups
                       if (entry := _kept.get(storage._cdata)) is not None
                       and entry.current(group.tensors)]
        unchanged = _unchanged(counted, copies, check, began, report)
        # each copy is queued after its fingerprint, on the same stream: a write between
        # the two makes them differ, and the release copies that storage again
        queued: list[tuple[_Group, Any, list[int | None], Any]] = []
        try:
            for group, storage in groups:
                if stop is not None and stop.is_set():
                    report.stopped = True
                    break
                if storage._cdata in unchanged:
                    continue
                versions = _versions(group.tensors)
                print_ = (None if check == "counters"
                          else copies.fingerprint(storage, group.device, check))
                group.host = _copy_to_host(copies, group, storage)  # a stale copy's buffer
                queued.append((group, storage, versions, print_))
            copies.synchronize(group.device for group, _, _, _ in queued)
            prints: list[int | None] = [None] * len(queued)
            if check != "counters":
                prints = list(_read_fingerprints([p for _, _, _, p in queued]))
        except BaseException:
            self._drop_host_copies([group for group, _, _, _ in queued], copies)
            raise
        if stop is not None and stop.is_set():
            # a cell started before every copy was done: its writes may have landed between
            # a fingerprint and its copy and been undone after (through .data, unseen by the
            # counters); none of these copies is trusted, the release makes its own
            self._drop_host_copies([group for group, _, _, _ in queued], copies)
            report.stopped = True
            report.seconds = time.perf_counter() - start
            return report
        # every copy made or checked here is current as of ``began`` if no code ran since:
        # the release can then trust it without a fingerprint (the pre-copy paid for it)
        made = _same_epoch(began)
        with _kept_lock:
            for (group, storage, versions, _), print_value in zip(queued, prints, strict=True):
                entry = _kept_entry(group, storage, group.host, print_value, check, made)
                entry.versions = versions
                _kept[storage._cdata] = entry
                report.copied += group.nbytes
                report.count += len(group.tensors)
            for key in unchanged:
                if (entry := _kept.get(key)) is not None:
                    entry.epoch = made
        report.seconds = time.perf_counter() - start
        return report

    def allocated_bytes(self) -> int:
        """Bytes of live tensors on the GPUs (what a release could copy at most)."""
        torch = _torch()
        if not torch.cuda.is_initialized():
            return 0
        return sum(torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count()))

    def offload(self, namespace: dict[str, Any]) -> OffloadReport:
        report = OffloadReport(framework=self.name)
        if self._groups:
            return report  # already offloaded: a second release moves nothing
        start = time.perf_counter()
        now = quiet.epoch()  # a kept copy current at this epoch was written by no one since
        reserved_before = _cuda_reserved()
        groups = self._find_groups(namespace, report)
        copies = self.copies
        check = kept_check()

        # 1. copy every storage to host (every device's copies queued, then one wait per
        # device), except those whose kept host copy is current (its version counters and
        # its fingerprint); nothing has changed yet if this fails (the kept copies taken go
        # back)
        with _kept_lock:
            counted = [(entry, storage) for group, storage in groups
                       if (entry := _kept.get(storage._cdata)) is not None
                       and entry.current(group.tensors) and not _storage_shared(entry.host)]
            unchanged = _unchanged(counted, copies, check, now, report)
            try:
                for group, storage in groups:
                    if storage._cdata in unchanged:
                        group.host, group.kept = _kept[storage._cdata].host, _kept.pop(storage._cdata)
                    else:  # into its stale kept copy's buffer when it has one
                        group.host = _copy_to_host(copies, group, storage)
                        report.copied += group.nbytes
                copies.synchronize(group.device for group, _ in groups
                                   if group.kept is None and group.host is not None)
            except BaseException:
                for group, storage in groups:
                    if group.kept is not None:
                        _kept[storage._cdata], group.kept, group.host = group.kept, None, None
                self._drop_host_copies([group for group, _ in groups])
                raise
            # the other kept copies are of storages gone or left on the device: freed now
            stale = bool(_kept)
            _kept.clear()
        if stale:
            _release_pinned_cache()
        # 2. re-point every tensor at its host copy; drop the last device references
        self._groups = _swap_groups(groups, report, copies.recycle)
        for group in self._groups:
            report.bytes += group.nbytes
            report.count += len(group.tensors)
            group.kept = None
        del groups
        _empty_caches()
        report.freed_bytes = max(0, reserved_before - _cuda_reserved())
        report.seconds = time.perf_counter() - start
        return report

    def reload(self) -> OffloadReport:
        report = OffloadReport(framework=self.name)
        if not self._groups:
            return report
        start = time.perf_counter()
        began = quiet.epoch()  # the kept copies are current as of it, if no code runs
        copies = self.copies
        # 1. allocate and fill every device storage; on failure (out of memory) the state is
        # still fully offloaded and a later reload can try again
        fresh: list[Any] = []
        try:
            for group in self._groups:
                fresh.append(copies.to_device(group.host, group.device))
            copies.synchronize(group.device for group in self._groups[:len(fresh)])
        except BaseException:
            if fresh:  # let queued copies finish before their target memory is freed
                try:
                    copies.synchronize(group.device for group in self._groups[:len(fresh)])
                except BaseException:
                    pass
            fresh = []
            _empty_caches()
            raise
        # 2. re-point the tensors at the device storages, then let the host copies go; if
        # one refuses, all are put back: still fully offloaded, a later reload can try again
        try:
            _swap(list(zip(self._groups, fresh, strict=True)))
        except BaseException:
            del fresh
            _empty_caches()
            raise
        for group in self._groups:
            report.bytes += group.nbytes
            report.count += len(group.tensors)
        groups, self._groups = self._groups, []
        # a host copy something else uses (a view taken while released) can change behind
        # the counters: never kept
        keep = [keep_host_copies() and not _storage_shared(group.host) for group in groups]
        prints: list[int | None] = [None] * len(groups)
        check = kept_check()
        if any(keep) and check != "counters":  # the restored bytes' fingerprints, one wait
            try:  # per device
                taken = _read_fingerprints([_FINGERPRINTS[check](storage) for storage, k
                                            in zip(fresh, keep, strict=True) if k])
            except Exception:  # no room for the temporaries: nothing is kept this time
                keep = [False] * len(groups)
            else:
                values = iter(taken)
                prints = [next(values) if k else None for k in keep]
        made = _same_epoch(began)
        with _kept_lock:
            for group, storage, k, print_ in zip(groups, fresh, keep, prints, strict=True):
                host, group.host = group.host, None
                if k:  # the next release copies what changes
                    _kept[storage._cdata] = _kept_entry(group, storage, host, print_, check,
                                                        made)
                else:  # kept for the next cycle (bounded), or freed
                    copies.recycle(host)
                del host
        del fresh
        copies.end_cycle()
        report.seconds = time.perf_counter() - start
        return report

    def _drop_host_copies(self, groups: list[_Group], copies: Any = None) -> None:
        """After a failed copy: wait for what was queued, then give the buffers back (or, if
        the wait fails, drop them: memory a copy may still write is never reused)."""
        copies = copies or self.copies
        taken = [group for group in groups if group.host is not None]
        try:
            copies.synchronize(group.device for group in taken)
        except BaseException:
            for group in taken:
                group.host = None
            _release_pinned_cache()
            return
        for group in taken:
            host, group.host = group.host, None
            copies.recycle(host)
            del host
        if isinstance(copies, LegacyCopies):
            _release_pinned_cache()

    # -- internals ---------------------------------------------------------------------------

    def _find_groups(
        self, namespace: dict[str, Any], report: OffloadReport
    ) -> list[tuple[_Group, Any]]:
        torch = _torch()
        result = walk_namespace(
            namespace,
            lambda obj: isinstance(obj, torch.Tensor),
            target_children=tensor_children,
            **self.walk_options,
        )
        if result.truncated:
            report.skip(
                f"<walk>: stopped after {result.visited} objects; "
                "tensors beyond them stay on the device"
            )
        groups: dict[int, tuple[_Group, Any]] = {}
        for found in result.found.values():
            tensor = found.obj
            try:
                if not self.is_device(tensor):
                    continue
                storage = tensor.untyped_storage()
            except Exception as exc:  # sparse, nested, wrapper subclasses without storage
                report.skip(f"{found.path}: {type(exc).__name__}: {exc}")
                continue
            key = storage._cdata
            if key not in groups:
                groups[key] = (_Group(self.device_of(storage), storage.nbytes()), storage)
            group = groups[key][0]
            group.tensors.append(tensor)
            group.paths.append(found.path)
        result.release()

        movable = []
        for group, storage in groups.values():
            # users = tensors sharing the storage + the one Python wrapper we hold
            users = torch._C._storage_Use_Count(storage._cdata)
            if users > len(group.tensors) + 1:
                report.skip(
                    f"{group.paths[0]}: its storage is also used by {users - 1 - len(group.tensors)}"
                    " tensor(s) outside the namespace (autograd graph, C++ or compiled state);"
                    " left on the device"
                )
                continue
            movable.append((group, storage))
        return movable


def _swap_groups(groups: list[tuple[_Group, Any]], report: OffloadReport,
                 recycle: Callable[[Any], None]) -> list[_Group]:
    """Re-point each group (with its device storage) at its host copy; a group that refuses
    stays on the device and is reported (its host copy goes to ``recycle``)."""
    try:
        _swap([(group, group.host) for group, _ in groups])  # fast path: one batch
        return [group for group, _ in groups]
    except UndoIncomplete:
        raise  # some tensors could not be put back: never carry on from a split state
    except Exception:
        pass  # rolled back: find the group that refuses, one at a time
    moved: list[tuple[_Group, Any]] = []
    for group, storage in groups:
        try:
            _swap([(group, group.host)])
        except UndoIncomplete:
            for done, device_storage in reversed(moved):  # the caller will not hold them
                try:
                    _swap([(done, device_storage)])
                except Exception:
                    pass  # UndoIncomplete is on its way up and says the state is damaged
            raise
        except Exception as exc:
            host, group.host = group.host, None
            recycle(host)
            del host
            report.skip(
                f"{group.paths[0]}: cannot be re-pointed ({type(exc).__name__}: {exc});"
                " left on the device"
            )
            continue
        moved.append((group, storage))
    return [group for group, _ in moved]


def _swap(moves: list[tuple[_Group, Any]]) -> None:
    """Point every tensor of each group at the group's new storage with the same view
    geometry, keeping autograd's version counters (a saved graph must not think its inputs
    were modified).

    All or nothing: if one tensor refuses, the ones already moved are put back
    (:class:`UndoIncomplete` if one of them cannot be)."""
    torch = _torch()
    tensors = [tensor for group, _ in moves for tensor in group.tensors]
    tracked = [t for t in tensors if not t.is_inference()]  # inference tensors have no version
    versions = [t._version for t in tracked]

    def changes():
        for group, storage in moves:
            for tensor, path in zip(group.tensors, group.paths, strict=True):
                old = tensor.untyped_storage()
                yield Change(
                    do=lambda t=tensor, s=storage: _set(torch, t, s),
                    undo=lambda t=tensor, s=old: _set(torch, t, s),
                    what=path,
                )

    try:
        apply_all(changes())
    finally:
        torch._C._autograd._unsafe_set_version_counter(tuple(tracked), tuple(versions))


def _set(torch: Any, tensor: Any, storage: Any) -> None:
    """Point ``tensor`` at ``storage`` with its own view geometry, across devices.

    ``tensor.set_(storage, ...)`` refuses a storage of another device ("the devices must
    match"), so a tensor of the same dtype and geometry is made on ``storage`` (``set_``
    on its own device) and assigned through ``.data``: the shallow copy that
    ``nn.Module.cuda()`` / ``.cpu()`` make, which takes the storage, geometry, device and
    dispatch keys and keeps the tensor's own autograd state (``requires_grad``, ``.grad``,
    view base, version counter). As there, a change of device lets autograd make a new
    gradient accumulator for a leaf at its next use (graphs built before keep theirs)."""
    if tensor.is_quantized:  # its quantizer (scales, zero points) is not a plain tensor's
        raise TypeError("a quantized tensor is not moved")
    inference = tensor.is_inference()
    # the new tensor must be an inference tensor exactly when ``tensor`` is one: its
    # dispatch keys are the ones ``tensor`` gets (an ambient inference mode is overridden;
    # entered only when needed: a context per tensor would double the cost of a move)
    if inference != torch.is_inference_mode_enabled():
        with torch.inference_mode(inference):
            new = _tensor_on(torch, tensor, storage)
    else:
        new = _tensor_on(torch, tensor, storage)
    tensor.data = new


def _tensor_on(torch: Any, tensor: Any, storage: Any) -> Any:
    """A new tensor on ``storage`` with ``tensor``'s dtype, geometry and lazy bits (no
    autograd: it does not require grad, and ``set_`` on its own device records nothing)."""
    new = torch.empty(0, dtype=tensor.dtype, device=storage.device)
    new.set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())
    if tensor.is_conj():  # the lazy conjugate and negative bits are dispatch keys too
        torch._C._set_conj(new, True)
    if tensor.is_neg():
        torch._C._set_neg(new, True)
    return new
