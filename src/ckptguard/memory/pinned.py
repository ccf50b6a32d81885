"""Exact-size pinned host buffers.

Contract: ``pinned_empty(nbytes)`` returns a ``PinnedBuffer`` whose pinned footprint is the
request, not the next power of two. PyTorch's caching host allocator (``pin_memory=True``,
``Tensor.pin_memory()``) rounds every request up to a power of two and keeps freed blocks cached
(+82% measured for a 1.1 GiB request), so a large long-lived block (optimizer offload, a sleep
backup) costs up to twice its size in host memory. Here the bytes come from a plain CPU tensor
of exactly ``nbytes`` and are page-locked with ``cudaHostRegister``.

The buffer is freed deterministically: ``close()`` (or leaving the ``with`` block) unregisters
the range first and only then drops the tensor; freeing registered memory first is the leak
pytorch PR #131270 fixed. After ``close()`` the tensor is gone; using it raises.

Without CUDA, ``pinned_empty`` raises ``PinnedMemoryUnavailableError`` and touches no CUDA API.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import ConfigError, PinnedMemoryUnavailableError

if TYPE_CHECKING:
    import torch

__all__ = [
    "HostRegistrar",
    "PinnedBuffer",
    "PinnedMemoryUnavailableError",
    "pinned_empty",
    "pow2_ceil",
]


def pow2_ceil(nbytes: int) -> int:
    """What the caching host allocator actually takes for a request of ``nbytes``."""
    if nbytes <= 1:
        return 1
    return 1 << (nbytes - 1).bit_length()


class HostRegistrar(Protocol):
    """Page-locks and releases a host address range (the seam the tests fake)."""

    def register(self, ptr: int, nbytes: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...


class _CudartRegistrar:
    # cudaHostRegisterDefault = 0; torch's own _pin_memory_utils passes 1 (portable) so every
    # context sees the range as pinned, which a multi-device process needs.
    FLAGS = 1

    def __init__(self) -> None:
        # The memory wing imports without torch, so `ckptguard mem` starts fast.
        import torch  # optional here

        if not torch.cuda.is_available():
            raise PinnedMemoryUnavailableError(
                "pinned_empty needs CUDA; torch.cuda.is_available() is False on this machine. "
                "Use a pageable tensor (torch.empty) where no GPU copies happen."
            )
        self._rt = torch.cuda.cudart()

    def register(self, ptr: int, nbytes: int) -> None:
        err = self._rt.cudaHostRegister(ptr, nbytes, self.FLAGS)
        if int(err) != 0:
            raise PinnedMemoryUnavailableError(
                f"cudaHostRegister({nbytes} bytes) failed with CUDA error {int(err)}; the host may "
                f"be out of lockable memory (check ulimit -l and the cgroup limit)"
            )

    def unregister(self, ptr: int) -> None:
        err = self._rt.cudaHostUnregister(ptr)
        if int(err) != 0:
            raise PinnedMemoryUnavailableError(
                f"cudaHostUnregister failed with CUDA error {int(err)}"
            )


class PinnedBuffer:
    """An exact-size, page-locked uint8 CPU tensor; close it (or use ``with``) to free it."""

    def __init__(self, nbytes: int, registrar: HostRegistrar) -> None:
        # The memory wing imports without torch, so `ckptguard mem` starts fast.
        import torch  # optional here

        self.nbytes = nbytes
        self._registrar = registrar
        self._lock = threading.Lock()
        self._tensor: torch.Tensor | None = torch.empty(nbytes, dtype=torch.uint8)
        self._ptr = self._tensor.data_ptr()
        try:
            registrar.register(self._ptr, nbytes)
        except BaseException:
            self._tensor = None
            raise

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise PinnedMemoryUnavailableError(
                "this PinnedBuffer was closed; its memory is released"
            )
        return self._tensor

    @property
    def closed(self) -> bool:
        return self._tensor is None

    def view(self, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The bytes as ``dtype`` (and ``shape``); views keep no extra pinned memory."""
        t = self.tensor.view(dtype)
        return t.view(shape) if shape is not None else t

    def close(self) -> None:
        """Unregister, then release the bytes. Idempotent."""
        with self._lock:
            if self._tensor is None:
                return
            self._registrar.unregister(self._ptr)
            self._tensor = None

    def __enter__(self) -> PinnedBuffer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        # A buffer dropped without close() must not leave a registered range over freed memory.
        # At interpreter shutdown CUDA may already be torn down: nothing left to release then.
        with contextlib.suppress(Exception):
            self.close()


def pinned_empty(nbytes: int, *, registrar: HostRegistrar | None = None) -> PinnedBuffer:
    """An exact-size pinned host buffer of ``nbytes`` bytes (uint8); see the module docstring."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
        raise ConfigError(f"pinned_empty: nbytes must be a positive int, got {nbytes!r}")
    return PinnedBuffer(nbytes, registrar if registrar is not None else _CudartRegistrar())
