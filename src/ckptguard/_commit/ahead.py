"""The first save_async's staging, prepared ahead: from the moment the state is known, off the
caller's path.

Contract: ``Ahead.arm(state, keyfn, prepare, *args)`` calls ``prepare(items, *args)`` with the
state's captured items (their tensor sizes size the pinned pool) as soon as every optimizer in the
state has state: at once, or after the first step of the optimizers that have none yet, from a
post-step hook that only reads. It never touches an optimizer (reading one without state would step
it, ``_state.state.read_optimizer``), never calls a stateful item's ``state_dict()`` (it may draw
from the global RNG), never raises into the user's step (a state the save cannot capture is reported
by the save), and arms once. It holds the bound method ``prepare`` weakly: the optimizer's hook
never keeps a dropped manager's pool alive. ``stop()`` removes the hooks (never inside one: torch
iterates its hook dicts while calling them).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .._state.state import Captured, ItemKind, KeyFn, capture, classify
from .._types import StateDict

log = logging.getLogger("ckptguard")

_SIZED = (ItemKind.MODULE, ItemKind.OPTIMIZER, ItemKind.TENSORS)
"""The kinds whose tensors a save stages (the pool's sizes); the others are read at the save."""


class Ahead:
    """The post-step hooks that wait for a fresh optimizer's state (see the module docstring)."""

    def __init__(self) -> None:
        self.armed = False
        self._hooks: list[Any] = []

    def arm(self, state: StateDict, keyfn: KeyFn, prepare: Callable[..., None], *args: Any) -> None:
        if self.armed:
            return
        self.armed = True
        empty = [v for v in state.values() if isinstance(v, torch.optim.Optimizer) and not v.state]
        weak = weakref.WeakMethod(prepare)
        if not empty:
            _prepare(state, keyfn, weak, args)
            return
        fired = [False]

        def after_step(*_: Any) -> None:
            # lr 0 in every group: DCP's own initialising step inside a restore's load, not training
            # yet.
            if fired[0] or any(not o.state for o in empty) or all(_zero_lr(o) for o in empty):
                return
            fired[0] = (
                True  # disarmed, not removed: torch iterates its hook dicts while calling them
            )
            _prepare(state, keyfn, weak, args)

        self._hooks = [o.register_step_post_hook(after_step) for o in empty]

    def stop(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def _zero_lr(optim: torch.optim.Optimizer) -> bool:
    return all(float(g.get("lr", 1.0)) == 0.0 for g in optim.param_groups)


def _prepare(
    state: StateDict, keyfn: KeyFn, weak: weakref.WeakMethod[Any], args: tuple[Any, ...]
) -> None:
    prepare = weak()
    if prepare is None:
        return  # the manager is gone
    try:
        # Only the items whose tensors size the pool: a stateful item's state_dict() may draw from
        # the global RNG (torchdata's StatefulDataLoader builds an iterator there), shifting a run
        # that never saves.
        sized = {name: v for name, v in state.items() if classify(v) in _SIZED}
        items: dict[str, Captured] = capture(sized, keyfn)
        prepare(items, *args)
    except (
        Exception
    ) as exc:  # never in the user's step: the save itself reports what it cannot capture
        log.debug("ckptguard: no staging prepared ahead: %s: %s", type(exc).__name__, exc)
