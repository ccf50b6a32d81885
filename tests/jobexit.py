"""The exit of a test job's process (tests/*_job.py): its interpreter's teardown without full
collections of the heap that torch, transformers and vLLM build.

A process ending normally collects its whole heap several times while it tears down (Py_FinalizeEx,
each module's clearing); vLLM's engine shutdown (an atexit finalizer) first undoes the
``gc.freeze()`` of its start and collects too. For a job of .venv-vllm on a loaded 2-core host that
is 7-10 s after its last line (tests/trl_vllm_job.py's training itself takes 5), on every launch
that exits. Frozen after every other finalizer, the heap is left to the process's end; atexit
handlers, module teardown and reference-counted destructors all still run, and the job's results
were written before any of it."""

from __future__ import annotations

import gc
import weakref


def freeze_at_exit() -> None:
    """Call first in the job, before any engine is made: ``weakref.finalize`` runs the newest
    finalizer first at exit, so this one runs after the engine's shutdown has unfrozen and
    collected. A torch.distributed default group still up is destroyed first: frozen, a group held
    in a reference cycle would meet the process's static destructors with its gloo threads running
    (``terminate called without an active exception``, SIGABRT: once, in the two-rank HF job of a
    fresh-clone run)."""
    weakref.finalize(gc, _teardown)


def _teardown() -> None:
    import contextlib
    import sys

    dist = sys.modules.get("torch.distributed")  # never imported here if the job did not
    if dist is not None and dist.is_available() and dist.is_initialized():
        # The job's results are written: the exit must not fail on the group's teardown.
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    gc.freeze()
