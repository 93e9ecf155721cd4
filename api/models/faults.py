"""What an error says: of a forward pass, out of memory (a smaller batch may pass) or a device
left unusable (only a restart helps); of a library call, its message in one line."""

from __future__ import annotations

# A kernel's fault (a device-side assert, an illegal address) leaves the CUDA context corrupt:
# the error is "sticky", and every later call on the device fails, whatever its input.
FATAL_MARKERS = ("cuda error", "device-side assert", "illegal memory access", "cudaerror")


class ForwardProcessLost(RuntimeError):
    """A model's forward process (api.models.forward_processes) exited, or stopped answering
    as its serving process expects: the model forwards in its serving process from then."""


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


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type when empty), at most 500 characters:
    libraries raise many types with long messages, each reported as one clear error."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:500]
