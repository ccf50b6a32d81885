"""Reading DCP's pickled ``.metadata`` without running pickled code."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import pickle
import pickletools
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ..errors import CheckpointCorruptError
from .base import DCP_METADATA
from .dcpindex import ALLOWED_NAMES, confine, read_bounded, scan_pickle, unreadable
from .dcpindex import METADATA_BYTES as METADATA_BYTES
from .dcpindex import plain_name as plain_name
from .dcpstructure import check_structure

# ---------------------------------------------------------------- restricted unpickling


class SafeMetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``.metadata`` allowing only DCP's own classes and torch dtypes.

    A crafted ``.metadata`` can name any callable (``os.system``); plain ``pickle.load``
    would call it. We refuse any global outside the allow-list before it is resolved.
    """

    def __init__(self, file: Any, *, extra: frozenset[tuple[str, str]] = frozenset()) -> None:
        super().__init__(file)
        self._allowed = ALLOWED_NAMES | extra

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name and (module, name) in self._allowed:
            return super().find_class(module, name)
        # vars(), never getattr: torch's lazy __getattr__ imports a module (torch.onnx, ...) before
        # the refusal.
        obj = vars(torch).get(name) if module == "torch" else None
        if isinstance(obj, (torch.dtype, torch.memory_format)):
            return obj
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


def _allowed_objects(extra: frozenset[tuple[str, str]] = frozenset()) -> list[Any]:

    out = []
    for module, name in sorted(ALLOWED_NAMES | extra):
        obj = getattr(importlib.import_module(module), name, None)
        if obj is not None:
            out.append(obj)
    return out


_FUNCTION_FIELDS = ("__defaults__", "__kwdefaults__", "__code__")


class _NoBuildOnGlobals:
    """Refuses a pickle that changed an allowed class or function (BUILD on a global sets its
    attributes: a DCP class's methods, a function's defaults, for every later use in the process),
    and puts back what it changed."""

    def __init__(self, extra: frozenset[tuple[str, str]] = frozenset()) -> None:
        self._extra = extra

    def __enter__(self) -> _NoBuildOnGlobals:
        self._before = [(o, _saved(o)) for o in _allowed_objects(self._extra)]
        return self

    def __exit__(self, *exc: Any) -> None:
        changed = []
        for obj, saved in self._before:
            now = _saved(obj)
            added = set(now) - set(saved)
            moved = [k for k, v in saved.items() if k not in now or now[k] is not v]
            if not added and not moved:
                continue
            changed.append(getattr(obj, "__qualname__", repr(obj)))
            for key in added:
                with contextlib.suppress(AttributeError, TypeError):
                    delattr(obj, key)
            for key in moved:
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(obj, key, saved[key])
        if changed and exc[0] is None:
            raise pickle.UnpicklingError(
                f"a BUILD on the global(s) {sorted(changed)} is not allowed in DCP metadata"
            )


def _saved(obj: Any) -> dict[str, object]:
    """What a pickle's BUILD could change on an allowed class or function: its attributes."""
    try:
        got = dict(vars(obj))
    except TypeError:  # a C type (torch.Size, OrderedDict, set): BUILD cannot set its attributes
        got = {}
    if not isinstance(obj, type):
        for name in _FUNCTION_FIELDS:
            if hasattr(obj, name):
                got[name] = getattr(obj, name)
    return got


def read_dcp_metadata(
    state_dir: str | os.PathLike[str], *, extra: frozenset[tuple[str, str]] = frozenset()
) -> Metadata:
    """DCP's ``.metadata`` of ``state_dir``, unpickled only through the allow-list.

    ``extra``: more exact ``(module, name)`` pairs a writer built on DCP puts there (Megatron-core
    adds its ranks' save plans: ``planner.SavePlan``, ``WriteItem``, ``TensorWriteData``).

    The file is read bounded and never through a link or from a FIFO, and every data
    file it names must be a plain file name inside ``state_dir``: DCP's own reader joins
    that name to the directory, so an absolute name or one with ``..`` would read tensor
    data from outside the checkpoint."""

    state_dir = Path(state_dir)
    path = state_dir / DCP_METADATA
    data = read_bounded(path)
    scan_pickle(
        path, data
    )  # the same pass the operator commands' reader runs: no declared size trusted
    try:
        with _NoBuildOnGlobals(extra):
            md = SafeMetadataUnpickler(io.BytesIO(data), extra=extra).load()
    except (
        Exception
    ) as exc:  # RecursionError, MemoryError-free garbage, a refused global: one error each
        raise unreadable(path, exc) from None
    if not isinstance(md, Metadata):
        raise CheckpointCorruptError(f"{path} holds a {type(md).__name__}, not DCP Metadata")
    confine(path, md)
    # The operator commands' reader runs the same check, and bounds the spans by the data files too.
    check_structure(path, md, data_files=False)
    return md


def pickle_globals(data: bytes) -> set[str]:
    """Every global a pickle names, without running it (for verify reports)."""
    names: set[str] = set()
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("GLOBAL", "INST") and isinstance(arg, str):
            names.add(arg.replace(" ", "."))
    return names
