"""What an error of a forward pass says: out of memory (a smaller batch may pass), or a device
left unusable (only a restart helps)."""

from __future__ import annotations

# A kernel's fault (a device-side assert, an illegal address) leaves the CUDA context corrupt:
# the error is "sticky", and every later call on the device fails, whatever its input.
FATAL_MARKERS = ("cuda error", "device-side assert", "illegal memory access", "cudaerror")


def is_out_of_memory(exc: BaseException) -> bool:
    """torch raises OutOfMemoryError on CUDA and a RuntimeError naming it on CPU."""
    return "OutOfMemory" in type(exc).__name__ or "out of memory" in str(exc).lower()


def is_fatal_device_error(exc: BaseException) -> bool:
    """An error that says CUDA error, device-side assert, illegal memory access or cudaError,
    and is not an out-of-memory (which a smaller batch may get past)."""
    if is_out_of_memory(exc):
        return False
    message = str(exc).lower()
    return any(marker in message for marker in FATAL_MARKERS)
