"""The host<->device link: the copies a swap engine issues, behind one interface, on CUDA or on the CPU.

A swap engine needs four things from the link, whatever the hardware:

- `copy_out(host, source)`: copy a device storage (`source`, a flat tensor) into a host slice, ordered
  after everything the compute stream has issued so far (the producer of `source`);
- `copy_in(buffer, host, after)`: copy a host slice into a device buffer, ordered after the compute
  stream so far (the buffer's previous life) and after the copy `after` (the swap-out that filled
  `host`: a reload must never read a host slot whose copy out has not landed);
- a `CopyEvent` per copy: `done()` asks without blocking, `wait()` orders the *compute* after the copy
  (on CUDA a device-side wait of the compute stream, the host never blocks; on the CPU the host blocks),
  `synchronize()` blocks the host;
- `fence()` between steps: the next step's copies out (which rewrite the host arena) run only after
  every copy already issued, ordered on the copy engines themselves (CUDA: the copy streams wait on
  each other's last events), so the host never waits; `synchronize()` blocks the host for every copy
  issued so far (before host memory is freed); `seconds()` for the copy time of the copies that have
  finished (read lazily: never a host synchronisation), `close()`.

When `host` is bf16 and the device tensor fp32 (`swap.compress: bf16`), the conversion runs on the
copy's own stream or thread, after the bytes have landed and before its event fires, so waiting on the
event covers it. (Converting on the host when the reload is issued, as `Tensor.copy_` does for a
pinned bf16 source into an fp32 CUDA tensor, would read the host slot before the swap-out finished.)

Backends (`open_link` picks one per device):

- `CudaLink`: a device-to-host and a host-to-device stream. The compute stream is the *current* stream
  at issue time (autograd, checkpointing and DDP may switch it). Events used only for ordering are
  created with `enable_timing=False`; each copy's done event doubles as the end of its timing pair, and
  `seconds()` sums only pairs whose end event has already completed (`query()`), leaving the rest for
  later calls.
- `EmulatedLink`: the CPU stand-in for a PCIe link, so that copies really are asynchronous without a
  GPU (`memory.swap.emulate_gbs`). One copy thread per direction takes jobs from a FIFO queue, copies
  the bytes, then sleeps for the rest of `bytes / bandwidth`: a copy of n bytes occupies its direction
  for max(real copy, n / bandwidth) seconds, as a copy engine would. Raw bytes move with `memmove`
  (one thread, GIL released) so the copy never fans out over torch's intra-op threads. On a 2-core
  machine a copy thread still slows a concurrent conv3d loop: with two torch threads by about 25% while
  it streams at an emulated 1 GB/s and 40% at 5 GB/s (one of the two intra-op threads loses its core);
  with one torch thread by 0.05-0.3 s per GB copied. So emulate low bandwidths (about 1 GB/s), and
  price the interference (`scripts/validate_plan.py` measures it, `OpCostModel.copy_interference_s_per_byte`
  prices it). Each job also takes the GIL for a moment to start and to finish, which Python hands over
  only every switch interval (5 ms) while the main thread runs Python: an emulated copy can be found
  finished a little later than a copy engine's would.
- `CopyLink` itself: the CPU default: every copy runs at once on the calling thread and its event is
  done.

`delay_s` (`memory.swap.copy_delay_s`) delays every copy by a random 0..delay_s seconds before it runs
(on the copy thread, or `torch.cuda._sleep` on the copy stream): a test knob that widens the windows in
which a missing wait would read unfinished data.
"""

from __future__ import annotations

import ctypes
import queue
import random
import threading
import time
import weakref

import torch

from brats_swap.config.schema import SwapConfig
from brats_swap.memory.arena import empty_unfilled
from brats_swap.memory.cost import bytes_per_second, link_seconds

# `torch.cuda._sleep` counts GPU clock cycles; when the device does not report its clock, assume this.
_FALLBACK_CLOCK_HZ = 1.5e9


class CopyEvent:
    """A copy already finished (what the synchronous `CopyLink` returns). Subclasses track copies in flight."""

    __slots__ = ()

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        """Order the compute after this copy (CUDA: the compute stream waits; CPU: the host waits)."""

    def synchronize(self) -> None:
        """Block the host until this copy has finished."""


FINISHED = CopyEvent()


class CopyLink:
    """The interface (see the module docstring); this base class is the synchronous CPU link."""

    asynchronous = False

    def __init__(self, delay_s: float = 0.0, sync: bool = False, seed: int | None = None):
        self.delay_s = delay_s
        self.sync = sync  # debug: the host waits for every copy right after issuing it
        self._rng = random.Random(seed)  # never torch's generator: dropout must draw the same masks
        self._seconds = 0.0

    def _delay(self) -> float:
        return self._rng.uniform(0.0, self.delay_s) if self.delay_s > 0 else 0.0

    def copy_out(self, host: torch.Tensor, source: torch.Tensor, staging: torch.Tensor | None = None) -> CopyEvent:
        """`staging` (CUDA, bf16 transport): the device buffer the conversion goes through."""
        return self._copy(host, source)

    def copy_in(self, buffer: torch.Tensor, host: torch.Tensor, after: CopyEvent | None = None,
                staging: torch.Tensor | None = None) -> CopyEvent:
        return self._copy(buffer, host)

    def _copy(self, destination: torch.Tensor, source: torch.Tensor) -> CopyEvent:
        delay = self._delay()
        if delay:
            time.sleep(delay)
        began = time.perf_counter()
        with torch.no_grad():
            destination.copy_(source)
        self._seconds += time.perf_counter() - began
        return FINISHED

    def seconds(self) -> float:
        """Copy time of the copies that have finished so far (cumulative)."""
        return self._seconds

    def synchronize(self) -> None:
        """Block the host until every copy issued so far has finished."""

    def fence(self) -> None:
        """Order every later copy after every copy issued so far, without blocking the host (module
        docstring). Synchronous copies have all finished already."""

    def close(self) -> None:
        """Stop the link's threads or streams; copies issued earlier have finished."""
        self.synchronize()


# --------------------------------------------------------------------------------------------------------
# Emulated link: one copy thread per direction
# --------------------------------------------------------------------------------------------------------


class ThreadCopyEvent(CopyEvent):
    """A copy queued on an emulated link's thread; set by that thread when the copy has finished."""

    __slots__ = ("_flag", "error", "seconds")

    def __init__(self):
        self._flag = threading.Event()
        self.error: BaseException | None = None
        self.seconds = 0.0

    def done(self) -> bool:
        return self._flag.is_set()

    def wait(self) -> None:
        self._flag.wait()
        if self.error is not None:
            raise RuntimeError(f"emulated link: a copy failed: {self.error}") from self.error

    synchronize = wait


def _move(destination: torch.Tensor, source: torch.Tensor) -> None:
    """One copy as the copy thread runs it: raw bytes with `memmove` (a single thread, GIL released),
    anything needing a conversion (bf16 <-> fp32) with `copy_`."""
    if (destination.dtype == source.dtype and destination.is_contiguous() and source.is_contiguous()
            and destination.numel() == source.numel()):
        nbytes = source.numel() * source.element_size()
        if nbytes:
            ctypes.memmove(destination.data_ptr(), source.data_ptr(), nbytes)
        return
    with torch.no_grad():
        destination.copy_(source)


def _copy_worker(jobs: queue.SimpleQueue, bytes_per_s: float) -> None:
    """The copy thread of one direction: FIFO, like a copy engine. Holds no reference to the link, so a
    link that is dropped without `close()` still stops its threads (its finalizer queues `None`)."""
    while True:
        job = jobs.get()
        if job is None:
            return
        event, destination, source, after, delay = job
        started = time.perf_counter()
        try:
            if after is not None:
                after.wait()
                started = time.perf_counter()  # the link is idle while the job waits for its dependency
            if delay:
                time.sleep(delay)
            _move(destination, source)
            remaining = started + delay + link_seconds(source.numel() * source.element_size(), bytes_per_s)
            remaining -= time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
        except BaseException as error:  # handed to whoever waits on the event
            event.error = error
        event.seconds = time.perf_counter() - started
        del job, destination, source, after  # the job's references go before the event says "done"
        event._flag.set()


class EmulatedLink(CopyLink):
    """Asynchronous CPU copies at `gbs` GB/s per direction (see the module docstring)."""

    asynchronous = True

    def __init__(self, gbs: float, delay_s: float = 0.0, sync: bool = False, seed: int | None = None):
        super().__init__(delay_s, sync, seed)
        self.bytes_per_s = bytes_per_second(gbs)
        self._queues: dict[str, queue.SimpleQueue] = {}
        self._threads: list[threading.Thread] = []
        self._issued: list[ThreadCopyEvent] = []
        self._last: dict[str, ThreadCopyEvent] = {}
        self._fence: ThreadCopyEvent | None = None  # the next copy out waits for this reload (`fence`)
        self._finalizer = weakref.finalize(self, _stop_workers, self._queues, self._threads)

    def _queue(self, direction: str) -> queue.SimpleQueue:
        if direction not in self._queues:
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            thread = threading.Thread(target=_copy_worker, args=(jobs, self.bytes_per_s),
                                      name=f"brats-swap-{direction}", daemon=True)
            thread.start()
            self._queues[direction] = jobs
            self._threads.append(thread)
        return self._queues[direction]

    def _submit(self, direction: str, destination: torch.Tensor, source: torch.Tensor,
                after: CopyEvent | None) -> ThreadCopyEvent:
        event = ThreadCopyEvent()
        pending = after if isinstance(after, ThreadCopyEvent) else None
        if direction == "d2h" and self._fence is not None:
            pending, self._fence = self._fence, None  # copies out wait for nothing else
        self._queue(direction).put((event, destination, source, pending, self._delay()))
        self._issued.append(event)
        self._last[direction] = event
        if self.sync:
            event.wait()
        return event

    def copy_out(self, host: torch.Tensor, source: torch.Tensor, staging: torch.Tensor | None = None) -> CopyEvent:
        return self._submit("d2h", host, source, None)  # the copy thread converts on the host: no staging

    def copy_in(self, buffer: torch.Tensor, host: torch.Tensor, after: CopyEvent | None = None,
                staging: torch.Tensor | None = None) -> CopyEvent:
        return self._submit("h2d", buffer, host, after)

    def seconds(self) -> float:
        still = []
        for event in self._issued:
            if event.done():
                self._seconds += event.seconds
            else:
                still.append(event)
        self._issued = still
        return self._seconds

    def synchronize(self) -> None:
        for event in self._issued:
            event._flag.wait()  # errors surface where the copy is used, not here

    def fence(self) -> None:
        """The next copy out waits (on its copy thread) for the last reload, which may still read the
        arena; earlier copies out are ahead of it in its FIFO queue, and reloads read only slots that
        copies out of their own step (ahead in that queue) wrote."""
        last = self._last.get("h2d")
        if last is not None and not last.done():
            self._fence = last

    def close(self) -> None:
        self.synchronize()
        self._finalizer()


def _stop_workers(queues: dict[str, queue.SimpleQueue], threads: list[threading.Thread]) -> None:
    for jobs in queues.values():
        jobs.put(None)
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(timeout=60)
    queues.clear()
    threads.clear()


# --------------------------------------------------------------------------------------------------------
# CUDA: a copy stream per direction
# --------------------------------------------------------------------------------------------------------


class CudaCopyEvent(CopyEvent):
    """The done event of a copy on a CUDA copy stream."""

    __slots__ = ("event", "device")

    def __init__(self, event, device: torch.device):
        self.event = event
        self.device = device

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)  # device-side: the host runs on

    def synchronize(self) -> None:
        self.event.synchronize()


class CudaLink(CopyLink):
    """Copies on a device-to-host and a host-to-device stream of `device` (see the module docstring)."""

    asynchronous = True

    def __init__(self, device: torch.device, delay_s: float = 0.0, sync: bool = False, seed: int | None = None):
        super().__init__(delay_s, sync, seed)
        self.device = torch.device(device)
        self.d2h = torch.cuda.Stream(self.device)
        self.h2d = torch.cuda.Stream(self.device)
        self._timing: list[tuple] = []  # (start, end) event pairs not summed yet, in issue order per stream
        self._last: dict[str, torch.cuda.Event] = {}
        clock_khz = getattr(torch.cuda.get_device_properties(self.device), "clock_rate", 0)
        self._cycles_per_s = clock_khz * 1e3 if clock_khz else _FALLBACK_CLOCK_HZ

    def _run(self, stream, name: str, body) -> CudaCopyEvent:
        start = torch.cuda.Event(enable_timing=True)
        done = torch.cuda.Event(enable_timing=True)  # orders the consumers and ends the timing pair
        with torch.cuda.stream(stream):
            delay = self._delay()
            if delay:
                torch.cuda._sleep(int(delay * self._cycles_per_s))
            start.record(stream)
            body()
            done.record(stream)
        self._timing.append((start, done))
        self._last[name] = done
        if self.sync:
            done.synchronize()
        return CudaCopyEvent(done, self.device)

    def copy_out(self, host: torch.Tensor, source: torch.Tensor, staging: torch.Tensor | None = None) -> CopyEvent:
        compute = torch.cuda.current_stream(self.device)
        ready = torch.cuda.Event(enable_timing=False)  # ordering only (also orders `staging`'s allocation)
        ready.record(compute)
        self.d2h.wait_event(ready)

        def body():
            # A bf16 host slot: convert on this stream into `staging` (the compute stream's block, held by
            # the caller until the compute waited for this copy), then move the bytes.
            staged = source
            if source.dtype != host.dtype:
                staged = staging.copy_(source) if staging is not None else source.to(host.dtype)
            host.copy_(staged, non_blocking=True)

        return self._run(self.d2h, "d2h", body)

    def copy_in(self, buffer: torch.Tensor, host: torch.Tensor, after: CopyEvent | None = None,
                staging: torch.Tensor | None = None) -> CopyEvent:
        compute = torch.cuda.current_stream(self.device)
        self.h2d.wait_stream(compute)  # the buffers were allocated (and maybe last used) on the compute stream
        if isinstance(after, CudaCopyEvent):
            self.h2d.wait_event(after.event)

        def body():
            if buffer.dtype == host.dtype:
                buffer.copy_(host, non_blocking=True)
            else:  # move the bf16 bytes into `staging`, then widen them on this stream, before the done event
                staged = staging if staging is not None else empty_unfilled(host.shape, dtype=host.dtype,
                                                                            device=self.device)
                staged.copy_(host, non_blocking=True)
                buffer.copy_(staged)

        return self._run(self.h2d, "h2d", body)

    def seconds(self) -> float:
        still = []
        for start, end in self._timing:
            if end.query():
                self._seconds += start.elapsed_time(end) / 1e3
            else:
                still.append((start, end))
        self._timing = still
        return self._seconds

    def synchronize(self) -> None:
        for event in self._last.values():  # FIFO streams: the last event covers every earlier copy
            event.synchronize()

    def fence(self) -> None:
        """The copy-out stream waits (on the device) for the last reload, which may still read the arena;
        FIFO streams order the rest (see `EmulatedLink.fence`)."""
        if "h2d" in self._last:
            self.d2h.wait_event(self._last["h2d"])


def open_link(device: torch.device, swap_cfg: SwapConfig, seed: int | None = None) -> CopyLink:
    """The link for copies between `device` and the host: CUDA streams for a CUDA device, the emulated
    link for a CPU device when `swap.emulate_gbs` is set, else synchronous copies."""
    delay = swap_cfg.copy_delay_s
    if device.type == "cuda":
        return CudaLink(device, delay, swap_cfg.sync, seed)
    if swap_cfg.emulate_gbs is not None:
        return EmulatedLink(swap_cfg.emulate_gbs, delay, swap_cfg.sync, seed)
    return CopyLink(delay, swap_cfg.sync, seed)
