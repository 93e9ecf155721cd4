"""Which errors of a forward pass leave the device unusable, so that only a restart helps."""

from __future__ import annotations

# A kernel's fault (a device-side assert, an illegal address) leaves the CUDA context corrupt:
# the error is "sticky", and every later call on the device fails, whatever its input.
FATAL_MARKERS = ("cuda error", "device-side assert", "illegal memory access", "cudaerror")


def is_fatal_device_error(exc: BaseException) -> bool:
    """An error that says CUDA error, device-side assert, illegal memory access or cudaError,
    and is not an out-of-memory (which a smaller batch may get past)."""
    message = str(exc).lower()
    if "out of memory" in message or "OutOfMemory" in type(exc).__name__:
        return False
    return any(marker in message for marker in FATAL_MARKERS)
