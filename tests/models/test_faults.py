"""Which forward-pass errors are fatal to the device: torch's own messages."""

from __future__ import annotations

import pytest

from api.models.faults import is_fatal_device_error

ASYNC_NOTE = (
    "\nCUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"
)
FATAL = {
    "device-side assert": RuntimeError("CUDA error: device-side assert triggered" + ASYNC_NOTE),
    "illegal address": RuntimeError("CUDA error: an illegal memory access was encountered"),
    "cuBLAS failure": RuntimeError(
        "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, ...)`"
    ),
    "driver's name": RuntimeError("cudaErrorLaunchFailure: unspecified launch failure"),
}
NOT_FATAL = {
    "out of memory": RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    "CUDA error that is an OOM": RuntimeError("CUDA error: out of memory" + ASYNC_NOTE),
    "a bad input": ValueError("inputs[0] has no tokens"),
    "a CPU error": RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x64 and 32x2)"),
}


@pytest.mark.parametrize("error", list(FATAL.values()), ids=list(FATAL))
def test_sticky_cuda_errors_are_fatal(error: BaseException) -> None:
    assert is_fatal_device_error(error)


@pytest.mark.parametrize("error", list(NOT_FATAL.values()), ids=list(NOT_FATAL))
def test_out_of_memory_and_other_errors_are_not(error: BaseException) -> None:
    assert not is_fatal_device_error(error)
