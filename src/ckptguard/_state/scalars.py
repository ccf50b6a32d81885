"""One exact scalar of a step's record (loss, grad_norm, an extra), without importing torch or
numpy.

A torch tensor or a NumPy value can only exist once its library was imported, so the checks look
the libraries up in ``sys.modules`` instead of importing them: the trust record (``_records.trust``)
reads a save's metrics through this, and the operator commands that read trust records start
without torch's 1-2 s import.
"""

from __future__ import annotations

import numbers
import sys
from typing import Any

from ..errors import ConfigError

Metrics = dict[str, float | int | bool | str]
"""A step's produced values by name (loss, grad_norm, the extras), each an exact scalar
(``scalar``)."""

__all__ = ["scalar"]


def scalar(name: str, value: Any) -> float | int | bool | str:
    """An exact scalar for the record; a tensor or NumPy number of one element is read out."""
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    tensor = torch is not None and isinstance(value, torch.Tensor)
    if tensor or (np is not None and isinstance(value, np.ndarray)):
        count = value.numel() if tensor else value.size
        if count != 1:
            raise ConfigError(
                f"record_step({name}=...): a {type(value).__name__} of {count} elements is not a "
                f"scalar; pass the tensors the step consumed as batch=..."
            )
        value = value.item()
    elif np is not None and isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise ConfigError(
        f"record_step({name}=...): {type(value).__name__} is not a number or string; extras are "
        f"the step's scalar outputs (reward, lr, tokens, ...), compared exactly on replay"
    )
