"""What a failed call of the host I/O raises: a system call that failed or moved no byte, a
page-lock that CUDA refused, a buffer that never came free.

``io_error`` turns a failed or short system call into an ``OSError`` with ``errno``, ``filename``
and the attributes the commit protocol reports: ``offset`` (file position of the failing call),
``requested_bytes`` and ``returned_bytes`` (what the call returned: a short count, 0, or -1 for an
errno); ``call_failed`` (the call raised) and ``moved_nothing`` (it returned 0) are the two cases of
``_pool``'s loops. A refused ``cudaHostRegister`` is a ``PinError`` (an ``OSError`` naming the CUDA
error: ``pin_refused``); a pool's ``get`` that waited out its timeout, a ``StorageStallError``
(``stalled``). None of it runs on a save or restore whose calls succeed.
"""

from __future__ import annotations

import errno as _errno
import os

from ..errors import StorageStallError

TRUNCATED = "the file ends before the bytes its DCP metadata points at; it was truncated"
"""Why a read returned 0 bytes: the file ends before the range it was asked for."""

_CUDA_ERRORS = {
    1: "cudaErrorInvalidValue",
    2: "cudaErrorMemoryAllocation: the system refused to page-lock more memory "
    "(ulimit -l, or memory is short)",
    712: "cudaErrorHostMemoryAlreadyRegistered: part of this range is still registered, "
    "left by a pinned buffer "
    "that was unmapped without cudaHostUnregister (by code outside "
    "ckptguard, or an older ckptguard)",
    801: "cudaErrorNotSupported",
}


class PinError(OSError):
    """``cudaHostRegister`` refused a host buffer: a CUDA/system condition, never a checkpoint's
    fault."""


def pin_refused(rc: int, size: int) -> PinError:
    """The refusal of a ``size``-byte buffer's registration, named by the CUDA error ``rc``."""
    what = _CUDA_ERRORS.get(rc, f"cudaError {rc}")
    return PinError(_errno.ENOMEM, f"cudaHostRegister of a {size} B host buffer failed: {what}")


def io_error(
    err: int, what: str, path: str, *, offset: int, requested: int, returned: int, cause: str = ""
) -> OSError:
    """An OSError carrying the figures ``failure_from`` reads with getattr."""
    detail = (
        f"{what} {path} failed at offset {offset}: requested {requested} B, returned {returned}"
    )
    exc = OSError(err, f"{detail} ({cause or os.strerror(err)})", path)
    exc.offset = offset  # type: ignore[attr-defined]
    exc.requested_bytes = requested  # type: ignore[attr-defined]
    exc.returned_bytes = returned  # type: ignore[attr-defined]
    return exc


def call_failed(exc: OSError, what: str, path: str, *, offset: int, requested: int) -> OSError:
    """The call raised ``exc``: its errno (EIO where it has none), returned -1."""
    return io_error(
        exc.errno or _errno.EIO, what, path, offset=offset, requested=requested, returned=-1
    )


def moved_nothing(
    what: str, path: str, *, offset: int, requested: int, cause: str = TRUNCATED
) -> OSError:
    """The call returned 0 bytes: EIO (a write would loop forever, a read found the file's end)."""
    return io_error(
        _errno.EIO, what, path, offset=offset, requested=requested, returned=0, cause=cause
    )


def stalled(timeout_s: float, what: str) -> StorageStallError:
    """No host buffer came free within ``timeout_s`` while ``what``: the storage stalled."""
    return StorageStallError(
        _errno.ETIMEDOUT,
        f"no host buffer came free within {timeout_s} s while {what}: the storage stalled (a hung "
        f"filesystem or device); raise StreamingConfig.stall_timeout_s only if it is just slow",
    )
