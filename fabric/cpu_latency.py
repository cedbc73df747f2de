"""Idle CPUs kept quick to wake while a process serves: a PM QoS request on /dev/cpu_dma_latency.

Every hop of the data path ends in a wake-up: an AW's call wakes an EW, its result wakes the AW. A CPU that idles
in a deep state takes tens of µs to run the woken process. On bare metal that is a C-state's exit; in a VM it is a
halted vCPU, whose host thread has gone to sleep and must be scheduled again (on the 2-vCPU VM this was measured
on, with guest halt polling off: a 4 KiB round trip between two processes took 58 µs, 13 µs with idle CPUs kept
polling; `bench/bench_wake.py`). Linux's PM QoS interface lets a process ask that no CPU enter an idle state whose
exit latency is over N µs, for as long as it holds /dev/cpu_dma_latency open. With 0, an idle CPU polls: it runs
the woken process at once. The kernel takes the lowest of all the requests held, and drops a request with its
file, so nothing outlives the process, however it ends.

The cost: idle CPUs poll instead of sleeping, which draws power, and on a VM its host sees the vCPUs busy. Writing
the file takes root, or a udev rule that gives the serving user the device; without it nothing changes.

The request is read by the kernel's cpuidle governor. A kernel that runs no cpuidle driver (a Firecracker guest reads
`none` in /sys/devices/system/cpu/cpuidle/current_driver) halts an idle CPU whatever is asked, so there the request
is held and changes nothing: the log says so (`idle_driver`). A driver (haltpoll in a KVM guest) or `idle=poll` on
the kernel's command line is what makes the request count there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from collections.abc import Iterator

DEVICE = "/dev/cpu_dma_latency"
IDLE_DRIVER = "/sys/devices/system/cpu/cpuidle/current_driver"

log = logging.getLogger(__name__)
_held: int | None = None  # this process's request, held open until it exits


def request(us: int, device: str = DEVICE) -> int | None:
    """Opens a request that idle CPUs wake within `us` µs: the file descriptor that holds it, or None (logged)
    where the kernel has no such device or this process may not write it. Closing the descriptor ends it."""
    try:
        fd = os.open(device, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as exc:
        log.info("idle CPUs wake at their own pace: cannot open %s (%s)", device, exc.strerror)
        return None
    try:
        os.write(fd, struct.pack("=i", us))  # the interface's binary form: one native 32-bit integer
    except OSError as exc:
        os.close(fd)
        log.info("idle CPUs wake at their own pace: %s refused %d µs (%s)", device, us, exc.strerror)
        return None
    return fd


def hold(us: int | None, device: str = DEVICE) -> bool:
    """Asks, for the rest of this process's life, that idle CPUs wake within `us` µs (None or negative: asks
    nothing). Returns whether the kernel took the request. A second call replaces the first."""
    global _held
    if _held is not None:
        os.close(_held)
        _held = None
    if us is None or us < 0:
        return False
    _held = request(us, device)
    if _held is not None:
        if idle_driver() == "none":
            log.info("asked for idle CPUs within %d µs of waking (%s), but this kernel runs no cpuidle driver (%s: "
                     "none): an idle CPU halts whatever is asked", us, device, IDLE_DRIVER)
        else:
            log.info("idle CPUs kept within %d µs of waking while this process serves (%s)", us, device)
    return _held is not None


def idle_driver(path: str = IDLE_DRIVER) -> str | None:
    """The kernel's cpuidle driver ("none" where it runs none, and then idle CPUs halt whatever PM QoS asks), or
    None where it cannot be read."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def current(device: str = DEVICE) -> int | None:
    """The kernel's current limit in µs, the lowest request held (2000000000: none), or None where it cannot be
    read."""
    try:
        with open(device, "rb") as f:
            raw = f.read(4)
    except OSError:
        return None
    return struct.unpack("=i", raw)[0] if len(raw) == 4 else None


@contextlib.contextmanager
def held(us: int, device: str = DEVICE) -> Iterator[bool]:
    """The request for the `with` block only (a benchmark's rounds with and without it): yields whether it was
    taken."""
    fd = request(us, device)
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)
