"""Adapters for where post-training users run: HF/TRL trainers, Ray actors, verl and OpenRLHF.

Contract: every adapter here is a thin layer over the public ``CheckpointManager``; none
changes the on-disk format or the commit protocol. Importing this package imports no
optional dependency: ``ray``, ``verl``, ``transformers``, ``deepspeed`` and ``megatron`` are
imported only by the functions that need them, and a missing one raises ``ConfigError`` naming
the package to install.

- ``ckptguard.integrations.ray``: rank 0's actor opens a rendezvous, every actor joins a gloo
  (or NCCL) process group; after that ckptguard behaves exactly as under ``torchrun``.
- ``ckptguard.integrations.external``: a ``Storage`` that commits files written by someone
  else (verl's workers, DeepSpeed) inside the same atomic step directory, checksummed in
  the manifest.
- ``ckptguard.integrations.verl``: a mixin replacing ``RayPPOTrainer._save_checkpoint`` and
  ``_load_checkpoint``, honouring verl's ``trainer.*`` checkpoint options.
- ``ckptguard.integrations.hf``: a mixin (or ``attach``) for ``transformers.Trainer`` and TRL
  trainers: each HF save one commit with HF's folder inside the step, exact resume through HF's
  own loader plus what HF does not save (the sampler's generator, RNG streams).
- ``ckptguard.integrations.openrlhf``: the same for ``DeepspeedStrategy.save_ckpt``/``load_ckpt``
  and the ``--ckpt.*`` flags.
- ``ckptguard.integrations.megatron``: Megatron-core's ``dist_checkpointing`` save of a model and
  its ``DistributedOptimizer`` committed inside the atomic step, its files checked without
  unrestricted unpickling, every shard compared with its saved xxh3 after Megatron's own load.
"""

from __future__ import annotations

__all__: list[str] = []
