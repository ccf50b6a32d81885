"""Host staging for ``save_async``: a reusable pool of exact-size host regions, copies that do
not hold the caller, and the fence every later mutation of the staged tensors waits on.

Contract:

- ``StagingPool`` holds host regions, each one anonymous mapping of exactly the bytes asked for,
  page-locked with ``cudaHostRegister`` when it stages GPU tensors (the caching host allocator would
  round a 6 GiB request up to 8 GiB and keep it cached). ``place(sizes, budget)`` gives every tensor
  a 64-byte aligned slot: first fit, largest tensor first, in the regions held, then ONE new region
  of exactly the bytes still missing, as far as ``budget`` (the pool's total) and ``grow`` (the
  bytes the caller's thread may allocate) allow; a tensor that does not fit gets None and stays
  live. Regions are reused by every later save and released by ``release()``, or by ``idle_s``
  seconds without use; either release is measured (bytes, RSS before and after) into the open phase
  recorder (``memory.phases.host_cache_released``). ``held_bytes`` is what the pool holds now.
  ``grow_async(sizes, budget)`` maps and pins, in a thread of its own (pinning 6 GiB takes over a
  second), the regions that hold what the pool cannot: packed largest first into regions of at most
  ``CHUNK`` bytes (one region per larger tensor), each exactly the bytes its slots take, so that the
  next ``place`` of the same sizes fills them exactly (the same first-fit order over regions no
  larger than the packing's) and no single registration holds the driver for long. While a region is
  being pinned nothing is placed in it.
- ``Copier`` fills slots: ``CudaCopier`` issues every GPU copy ``non_blocking`` on one side
  stream that first waits for the caller's current stream (the kernels that produced the
  tensors), and keeps the sources alive for that stream (``record_stream``); CPU sources are
  copied at once. ``fence()`` ends the batch.
- ``Fence``: ``host_wait()`` blocks until the copies landed (the background writer, before it
  reads a slot); ``before_mutation()`` is what an optimizer step or ``staged()`` calls before the
  live tensors change: it waits until the tensors that did not fit the pool were read by the
  writer (host side, timed: that is the honest cost of a state larger than the pool), then makes
  the caller's stream wait for the copies on the GPU, without blocking the CPU.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from ..errors import CheckpointError
from ..memory import phases as _phases
from ..memory.sampler import self_rss
from ._pool import Buffer

log = logging.getLogger("ckptguard")

ALIGN = 64  # every slot starts on a multiple of this: any dtype's view is aligned
CHUNK = 64 << 20
"""The largest region ``grow_async`` packs several tensors into (a larger tensor gets its own): each
registration holds the CUDA driver, and the training thread's calls wait for it, so it stays
short."""
YIELD_S = 0.001
"""The pause between two background registrations: the training thread's CUDA calls go first."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class StagingPool:
    """Exact-size host regions reused across saves (see the module docstring)."""

    def __init__(self, *, pin: bool, idle_s: float | None = None) -> None:
        self.pin = pin
        self.idle_s = idle_s
        self._regions: list[Buffer] = []
        self._used: list[int] = []  # bytes placed in each region by the current save
        self._lock = threading.Lock()
        self._busy = 0
        self._last_use = time.monotonic()
        self._timer: threading.Timer | None = None
        self.released_idle = 0
        """How many times the idle timer released the pool."""
        self._growing: Future[int] | None = None
        self._stopped = threading.Event()
        """Set by ``stop_growing``: a background grow maps no further region (a closing manager's
        pool)."""
        self.grown_on: list[str] = []
        """The names of the threads that allocated (and pinned) each region."""

    @property
    def held_bytes(self) -> int:
        return sum(r.size for r in self._regions)

    @property
    def growing(self) -> bool:
        """A region is being allocated in the background (``grow_async``)."""
        return self._growing is not None and not self._growing.done()

    def grow_async(self, sizes: Sequence[int], budget: int) -> Future[int]:
        """Map (and pin) in a background thread the regions that hold what ``sizes`` cannot find
        room for in the regions held (within ``budget`` less what is held); the future gives the
        bytes added (0: no room, or a grow already running)."""
        with self._lock:
            running = self._growing if self.growing else None
        if running is not None:
            return self._after(running, sizes, budget)
        if self._stopped.is_set():
            done0: Future[int] = Future()
            done0.set_result(0)
            return done0
        with self._lock:
            room = max(0, self.budget_room(budget))
            bins = self._new_bins(sizes)
            plan = []
            for b in bins:  # in packing order, which place() fills in the same order
                if b <= room:
                    plan.append(b)
                    room -= b
            done: Future[int] = Future()
            self._growing = done
        if not plan:
            done.set_result(0)
            return done
        threading.Thread(
            target=self._grow, args=(plan, done), name="ckptguard-pin-pool", daemon=True
        ).start()
        return done

    def _after(self, running: Future[int], sizes: Sequence[int], budget: int) -> Future[int]:
        """A grow asked for while one runs: run once it ended, for what is still missing then
        (prepare_async's pool for a fresh model, then the optimizer's state after its first step);
        the bytes both added."""
        chained: Future[int] = Future()

        def again(first: Future[int]) -> None:
            added = first.result() if first.exception() is None else 0

            def settle(f: Future[int]) -> None:
                error = f.exception()
                if error is not None:
                    chained.set_exception(error)
                else:
                    chained.set_result(added + f.result())

            self.grow_async(sizes, budget).add_done_callback(settle)

        running.add_done_callback(again)
        return chained

    def stop_growing(self) -> None:
        """Map no further region in the background (``close``: it then waits for at most the region
        in flight, not for a whole 6 GiB pool to be pinned only to be unpinned)."""
        self._stopped.set()

    def budget_room(self, budget: int) -> int:
        """What ``budget`` leaves beside the regions held."""
        return budget - self.held_bytes

    def _grow(self, plan: list[int], done: Future[int]) -> None:
        added = 0
        try:
            for need in plan:
                if self._stopped.is_set():
                    # closing: the regions mapped so far are released by the caller, the rest never
                    # mapped
                    break
                region = Buffer(need, self.pin)
                with self._lock:
                    self._regions.append(region)
                    self._used.append(0)
                    self.grown_on.append(threading.current_thread().name)
                added += need
                time.sleep(YIELD_S)
        except OSError as exc:
            log.warning(
                "ckptguard: could not allocate a %d B staging region in the background (%s); the "
                "tensors it would hold are read from the live state",
                need,
                exc,
            )
        except BaseException as exc:
            done.set_exception(exc)
            return
        done.set_result(added)

    def _new_bins(self, sizes: Sequence[int]) -> list[int]:
        """The exact sizes of the regions ``sizes`` need beyond the regions held (largest first)."""
        used = [0] * len(self._regions)
        bins: list[int] = []
        for n in sorted((n for n in sizes if n), reverse=True):
            if (
                _fit(used, [r.size for r in self._regions], n) is None
                and _fit(bins, None, n) is None
            ):
                bins.append(n)
        return bins

    def missing(self, sizes: Sequence[int]) -> int:
        """Bytes the regions for ``sizes`` would need beyond what the pool holds (``grow_async``'s
        packing)."""
        with self._lock:
            return sum(self._new_bins(sizes))

    def place(
        self, sizes: Sequence[int], budget: int, *, grow: int | None = None
    ) -> list[torch.Tensor | None]:
        """A uint8 slot of each size (None where the pool and the budget have no room); marks the
        pool busy. ``grow``: at most these bytes are mapped (and pinned) on the caller's thread
        (None: any)."""
        with self._lock:
            self._cancel_timer()
            self._busy += 1
            self._used = [0] * len(self._regions)
            out: list[torch.Tensor | None] = [None] * len(sizes)
            missing = []
            for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
                slot = self._first_fit(sizes[i])
                if slot is None:
                    missing.append(i)
                out[i] = slot
            room = max(0, budget - self.held_bytes)
            if grow is not None:
                room = min(room, grow)
            fit, need = [], 0
            for i in missing:
                end = (
                    _aligned(need) + sizes[i]
                )  # the last slot ends the region: no padding after it
                if end <= room:
                    fit.append(i)
                    need = end
            if need:
                try:
                    region = Buffer(need, self.pin)
                except OSError as exc:
                    # No pinnable memory now: those tensors stay live (reported by the caller as
                    # live bytes, read by the writer) instead of failing the save.
                    log.warning(
                        "ckptguard: could not allocate a %d B staging region (%s); the tensors it "
                        "would hold are read from the live state",
                        need,
                        exc,
                    )
                    return out
                self._regions.append(region)
                self._used.append(0)
                for i in fit:
                    out[i] = self._first_fit(sizes[i])
            return out

    def _first_fit(self, n: int) -> torch.Tensor | None:
        for r, region in enumerate(self._regions):
            start = _aligned(self._used[r])
            if start + n <= region.size:
                self._used[r] = start + n
                return region.tensor[start : start + n]
        return None

    def done(self) -> None:
        """The save that placed slots finished with them; the idle timer starts."""
        with self._lock:
            self._busy = max(0, self._busy - 1)
            self._arm_idle()

    def idle_from_now(self) -> None:
        """Start the idle timer of a pool no save has used yet (prepared ahead): an unused pool goes
        too."""
        with self._lock:
            if self._timer is None:
                self._arm_idle()

    def _arm_idle(self) -> None:
        self._last_use = time.monotonic()
        if self._busy == 0 and self.idle_s is not None and self._regions:
            self._cancel_timer()
            # A weak reference: a pool dropped without close() must not live on in its timer's
            # thread.
            self._timer = threading.Timer(self.idle_s, _idle_release, args=(weakref.ref(self),))
            self._timer.daemon = True
            self._timer.start()

    def _idle(self) -> None:
        with self._lock:
            if (
                self._busy == 0
                and self.idle_s is not None
                and time.monotonic() - self._last_use >= self.idle_s * 0.99
            ):
                self._release_locked(f"idle: {self.idle_s:g} s without a save_async")
                self.released_idle += 1

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def release(self) -> None:
        """Unregister and unmap every region now; the next save allocates again."""
        with self._lock:
            self._cancel_timer()
            self._release_locked("release()")

    def _release_locked(self, how: str) -> None:
        held = self.held_bytes
        before = self_rss() if held else None
        for region in self._regions:
            region.release()
        self._regions.clear()
        self._used.clear()
        if held:
            _record_release(held, how, self.pin, before)


def _record_release(held: int, how: str, pinned: bool, before: int | None) -> None:
    """The measured release in the active phase recorder (guide: verify the host cache is released
    after a save); a recorder that cannot write never fails the release, it is logged."""
    try:
        _phases.host_cache_released(
            held, how, pinned=pinned, rss_before=before, rss_after=self_rss()
        )
    except (OSError, CheckpointError) as exc:
        log.warning(
            "ckptguard: the release of %d B of host staging (%s) was not recorded "
            "in the phase records: %s",
            held,
            how,
            exc,
        )


def _fit(used: list[int], caps: list[int] | None, n: int) -> int | None:
    """First fit of ``n`` bytes in bins of ``caps`` (None: ``CHUNK`` each) holding ``used`` bytes:
    the bin's index, its ``used`` updated; None: no bin has room."""
    for b, u in enumerate(used):
        start = _aligned(u)
        if start + n <= (caps[b] if caps is not None else max(CHUNK, u)):
            used[b] = start + n
            return b
    return None


def _idle_release(ref: weakref.ref[StagingPool]) -> None:
    pool = ref()
    if pool is not None:
        pool._idle()


class Fence:
    """What a mutation of the live tensors waits for (see the module docstring)."""

    def __init__(
        self,
        *,
        host_wait: Callable[[], None],
        device_wait: Callable[[], None],
        live: bool,
        timeout_s: float,
    ) -> None:
        self._host_wait, self._device_wait = host_wait, device_wait
        self._live_read = threading.Event()
        if not live:
            self._live_read.set()
        self.timeout_s = timeout_s
        self.waited_s = 0.0
        """Seconds the caller's thread waited in ``before_mutation`` (the live tensors being
        read)."""
        self._passed = False
        self._also: list[Any] = []

    def also_wait(self, event: Any) -> None:
        """``host_wait`` waits for this CUDA event too (the clones into spare GPU memory)."""
        self._also.append(event)

    def host_wait(self) -> None:
        for event in self._also:
            event.synchronize()
        self._host_wait()

    def live_read(self) -> None:
        """The writer no longer reads the live tensors (done or failed)."""
        self._live_read.set()

    @property
    def passed(self) -> bool:
        return self._passed

    def before_mutation(self) -> float:
        """Wait until the live tensors may change; returns the seconds this call blocked."""
        if self._passed:
            return 0.0
        t0 = time.monotonic()
        if not self._live_read.wait(self.timeout_s):
            raise CheckpointError(
                f"the background save still reads the tensors that did not fit the staging pool "
                f"after {self.timeout_s:.0f} s; the storage stalled. Check the checkpoint storage, "
                f"or raise CheckpointConfig.timeout_s if it is only slow"
            )
        self._device_wait()
        self._passed = True
        waited = time.monotonic() - t0
        self.waited_s += waited
        return waited


class HostCopier:
    """Copies now, in the caller's thread (a state with no GPU tensor)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def fence(self, *, live: bool, timeout_s: float) -> Fence:
        return Fence(
            host_wait=lambda: None, device_wait=lambda: None, live=live, timeout_s=timeout_s
        )


class CudaCopier:
    """Non-blocking D2H copies on one side stream; CPU sources copied at once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        # The side stream sees every kernel the caller queued so far: the values of this step.
        self.stream.wait_stream(torch.cuda.current_stream(device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if src.device.type != "cuda":
            dst.copy_(src)
            return
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        # A temporary source (an optimizer state dict's converted tensor) freed by the caller
        # must not be handed to another kernel before this stream read it.
        src.record_stream(self.stream)

    def fence(self, *, live: bool, timeout_s: float) -> Fence:
        event = torch.cuda.Event()
        event.record(self.stream)
        device = self.device

        def device_wait() -> None:
            torch.cuda.current_stream(device).wait_event(event)

        return Fence(
            host_wait=event.synchronize, device_wait=device_wait, live=live, timeout_s=timeout_s
        )


def slot_view(slot: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``slot``'s bytes as a contiguous tensor of ``like``'s dtype and shape."""
    if like.numel() == 0:
        return torch.empty(like.shape, dtype=like.dtype)
    return slot.view(like.dtype).view(like.shape)


def release_quietly(pool: StagingPool | None) -> None:
    if pool is not None:
        with contextlib.suppress(Exception):
            pool.release()


def copier_for(sources: Sequence[torch.Tensor]) -> Any:
    """A CUDA copier on the first GPU source's device, else a host copier."""
    for t in sources:
        if t.device.type == "cuda":
            return CudaCopier(t.device)
    return HostCopier()
