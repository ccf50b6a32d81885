"""The reshard rule of every state item, as a save records it (``manifest.json`` field ``reshard``).

The rules themselves are applied by ``_resume.reshard`` (which documents each); what a save
records is decided here, from the live objects, below both the commit and the resume side.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._types import JsonObject
from ..cursor import DataCursor
from .rng import RNG_ITEM, GeneratorState
from .state import ItemKind, PerRank, classify

DCP, REPLICATED, DATA_CURSOR, USER, RNG = "dcp", "replicated", "data_cursor", "user", "rng_rederive"
TENSOR_KINDS = (ItemKind.MODULE, ItemKind.OPTIMIZER, ItemKind.TENSORS)


def fn_name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def declared(
    state: Mapping[str, Any], *, replicated: Sequence[str], rng_seed: int | None, capture_rng: bool
) -> dict[str, JsonObject]:
    """The rule of every item of ``state`` that has one (JSON, as recorded in the manifest)."""
    rules: dict[str, dict[str, Any]] = {}
    for name, value in state.items():
        kind = classify(value)
        if kind in TENSOR_KINDS:
            rules[name] = {"rule": DCP}
        elif isinstance(value, DataCursor):
            rules[name] = {"rule": DATA_CURSOR}
        elif isinstance(value, PerRank) and value.reshard is not None:
            rules[name] = {"rule": USER, "fn": fn_name(value.reshard)}
        elif name in replicated:
            rules[name] = {"rule": REPLICATED}
        elif isinstance(value, GeneratorState) and rng_seed is not None:
            rules[name] = {"rule": RNG, "seed": rng_seed}
    if capture_rng and rng_seed is not None:
        rules[RNG_ITEM] = {"rule": RNG, "seed": rng_seed}
    return rules
