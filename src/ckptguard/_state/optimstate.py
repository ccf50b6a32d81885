"""An optimizer's state dict read without changing the optimizer.

Contract: ``read(model, optim, name)`` returns what DCP's ``get_optimizer_state_dict`` returns
(state and param groups keyed by parameter FQN), and never steps, initialises or otherwise
mutates ``optim``. DCP initialises an optimizer that has no state yet by running ``step()`` with
zero gradients and lr 0 (``_init_optim_state``): Adam's ``step`` becomes 1 before the first real
step, so every later update uses a bias correction off by one and the run diverges bitwise from
the same run without a checkpoint library. An optimizer that never stepped has no moments to
save: its state dict is its param groups and an empty state. ``load_target`` is the read a
restore loads into: there DCP's initialisation is what gives the tensors DCP fills, and the
loaded state replaces everything it set.
"""

from __future__ import annotations

from itertools import chain

import torch
from torch.distributed.checkpoint.state_dict import _get_fqns, get_optimizer_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel

from .._types import StateDict
from ..errors import ConfigError


def read(model: torch.nn.Module, optim: torch.optim.Optimizer, name: str) -> StateDict:
    """``optim``'s state dict by FQN, as DCP gives it; an optimizer without state is not stepped to read it."""
    if optim.state:  # DCP initialises only an optimizer whose state is empty
        return get_optimizer_state_dict(model, optim)
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        # FSDP1 renames flat parameters inside its own optim_state_dict; only DCP's path knows how, and that
        # path steps the optimizer first.
        raise ConfigError(
            f"optimizer {name!r} has never stepped and its model is wrapped in FSDP1 (FullyShardedDataParallel): "
            "its state can only be read by stepping it, which would change the training. Save after the first "
            "optimizer step, or shard the model with FSDP2 (fully_shard)"
        )
    return _unstepped(model, optim)


def load_target(model: torch.nn.Module, optim: torch.optim.Optimizer) -> StateDict:
    """The state dict a restore loads a stepped optimizer's saved state into (DCP's: it initialises an empty one)."""
    return get_optimizer_state_dict(model, optim)


def _unstepped(model: torch.nn.Module, optim: torch.optim.Optimizer) -> StateDict:
    """An optimizer with no state: its param groups with parameter indices mapped to FQNs, as DCP maps them."""
    osd = optim.state_dict()
    params = list(chain.from_iterable(g["params"] for g in optim.param_groups))
    index = {id(p): i for i, p in enumerate(params)}
    fqn_of: dict[int, str] = {}
    for key, param in model.named_parameters():
        if id(param) in index:
            fqn_of[index[id(param)]] = next(iter(_get_fqns(model, key)))
    groups = [{**g, "params": [fqn_of[i] for i in g["params"]]} for g in osd["param_groups"]]
    return {"state": {}, "param_groups": groups}
