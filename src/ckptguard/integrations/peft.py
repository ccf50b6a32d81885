"""LoRA/PEFT checkpoints: the adapter and its optimizer state only, bound to the base model they
belong to.

Contract: ``LoraCheckpoint(manager, model, optim, base_dir=...)`` saves, as one ckptguard step, the
trainable parameters of a ``peft`` model (``AdapterModule``: a module item holding exactly those
parameters, so DCP, the layout-free digests and the optimizer's FQNs see nothing else), their
optimizer's state, and ``LoraBinding``: the base model's identity and the adapter config.

The base identity is what ``base_dir`` (the base model's Hugging Face folder) holds: each weights
file's size and xxh3 and each base tensor's layout-free digest. It is computed once per set of file
contents and cached in ``<root>/lora_base_cache.json``, keyed by each file's path, size, mtime and
inode (a file is hashed again only when one of those changes) and, for the tensor digests, by the
files' xxh3.

``restore`` refuses, before any tensor is read, a base whose files differ from the saved identity
(naming the files), an adapter config that differs (naming the fields), and after the restore a
model whose in-memory base weights differ from the base files' (naming the tensors: a base with an
adapter already merged into it, the "merged twice" failure, is refused here). ``ckptguard export
--merged`` writes base + adapter merged once (``ckptguard.ops.merge``).

For a rollout engine (``integrations.vllm.push_weights``): ``merged_state(model)`` is the base
model's state with every LoRA-targeted weight replaced by ``W + delta`` computed out of place by
peft's own ``get_delta_weight`` (bitwise what ``merge_adapter`` would put there; the model is left
unmerged), and refused on a model whose adapter is merged already (merging it again would add the
delta twice) or, with a ``LoraBinding``, whose in-memory base differs from the base files (a merge
whose flag was lost). ``merge_count(...)`` measures, independently of peft's computation, how many
times the adapter's delta is in a weight: ``(W_e - W) x`` against ``scaling * B (A x)`` in float64
for a random probe ``x``. ``adapter_probe(payload, adapter)`` samples a few fixed entries of each
targeted weight's base, delta and exported value into an export record (``mgr.record_export(step,
payload, adapter=adapter_probe(payload, model))``), so ``prove`` can name a first export after a
restore that holds ``base + k x delta`` (k = 2: merged twice) against the saving run's base.

Pinned and checked: peft 0.21.2 (plain LoRA on Linear layers; DoRA, rank/alpha patterns and LoRA
biases are refused by the merge). The in-memory base check covers plain (non-DTensor) base weights.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch
import xxhash

from .._disk import layout as _layout
from .._disk.digest import file_digest
from ..errors import ConfigError, StateMismatchError
from ..ops.hffiles import digests, read_tensors

__all__ = [
    "ADAPTER_ITEM",
    "BINDING_ITEM",
    "AdapterModule",
    "LoraBinding",
    "LoraCheckpoint",
    "LoraFactors",
    "adapter_probe",
    "base_identity",
    "base_name",
    "is_peft_model",
    "lora_factors",
    "merge_count",
    "merged_state",
    "read_binding",
]

ADAPTER_ITEM = "adapter"
BINDING_ITEM = "lora"
OPTIM_ITEM = "optim"
CACHE_NAME = "lora_base_cache.json"
_PREFIX = "base_model.model."
_SEP = "-"  # stands for "." in a parameter name (a module's parameter names cannot hold dots)
# Adapter-config fields that say nothing about the adapter's function: never a difference.
_VOLATILE = ("peft_version", "inference_mode", "base_model_name_or_path", "revision")


class AdapterModule(torch.nn.Module):
    """Exactly the trainable parameters of ``model`` (the same Parameter objects), as one module."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        for name, param in model.named_parameters():
            if param.requires_grad:
                if _SEP in name:
                    raise ConfigError(
                        f"parameter {name!r} has a {_SEP!r} in its name; "
                        f"AdapterModule uses it for '.'"
                    )
                self.register_parameter(name.replace(".", _SEP), param)
        if not list(self.parameters()):
            raise ConfigError("the model has no trainable parameter: nothing to save as an adapter")


def original_name(key: str) -> str:
    """An AdapterModule parameter's name (or its DCP key without the item) as the PEFT model names
    it."""
    return key.replace(_SEP, ".")


def base_name(name: str) -> str | None:
    """The base model's tensor name of a PEFT model's frozen parameter (None: not a base weight)."""
    if ".lora_" in name or not name.startswith(_PREFIX):
        return None
    return name[len(_PREFIX) :].replace(".base_layer.", ".")


def _plain(value: Any) -> Any:
    """An adapter-config value as plain JSON types (sets sorted, enums by value)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def adapter_config(model: Any, adapter: str = "default") -> dict[str, Any]:
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping) or adapter not in configs:
        raise ConfigError(
            f"the model is not a peft model with an adapter {adapter!r} (no "
            f"peft_config[{adapter!r}])"
        )
    plain = _plain(configs[adapter].to_dict())
    assert isinstance(plain, dict)
    return {k: v for k, v in sorted(plain.items()) if k not in _VOLATILE}


# ---------------------------------------------------------------- the base identity


def _weight_files(base_dir: Path) -> list[Path]:
    files = sorted(base_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"{base_dir} holds no *.safetensors file: pass the base model's Hugging Face folder"
        )
    return files


def _cache(cache_dir: Path | None) -> tuple[Path | None, dict[str, Any]]:
    if cache_dir is None:
        return None, {"files": {}, "tensors": {}}
    path = cache_dir / CACHE_NAME
    try:
        data = _layout.read_json(path, limit=64 << 20, what="LoRA base cache")
    except (FileNotFoundError, ValueError, OSError):
        data = None
    ok = (
        isinstance(data, dict)
        and isinstance(data.get("files"), dict)
        and isinstance(data.get("tensors"), dict)
    )
    return path, data if ok else {"files": {}, "tensors": {}}


def base_identity(base_dir: Path, *, cache_dir: Path | None = None) -> dict[str, Any]:
    """``{"dir", "files": {name: [size, xxh3]}, "tensors": {name: layout-free digest}}`` of a base
    model folder."""
    identity, cache = _identity_and_cache(base_dir, cache_dir)
    write_cache(cache_dir, cache)
    return identity


def write_cache(cache_dir: Path | None, cache: dict[str, Any]) -> None:
    path = None if cache_dir is None else cache_dir / CACHE_NAME
    if (
        path is not None and path.parent.is_dir()
    ):  # the root exists once the first save began; never created here
        _layout.atomic_write_json(path, cache)


def _identity_and_cache(
    base_dir: Path, cache_dir: Path | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    base_dir = base_dir.absolute()
    _path, cache = _cache(cache_dir)
    files = {}
    for f in [
        *_weight_files(base_dir),
        *([base_dir / "config.json"] if (base_dir / "config.json").exists() else []),
    ]:
        st = f.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
        hit = cache["files"].get(str(f))
        if not (isinstance(hit, list) and hit[:3] == stamp):
            hit = [*stamp, file_digest(str(f))[1]]
            cache["files"][str(f)] = hit
        files[f.name] = [st.st_size, hit[3]]
    key = json.dumps(sorted(files.items()))
    tensors = cache["tensors"].get(key)
    if not isinstance(tensors, dict):
        tensors = {}
        for f in _weight_files(base_dir):
            for name, t in read_tensors(f):
                tensors[name] = _digest(t)
        cache["tensors"] = {
            key: tensors
        }  # the current contents only: the cache never grows without bound
    return {"dir": str(base_dir), "files": files, "tensors": tensors}, cache


def _digest(t: torch.Tensor) -> str:
    return digests({"t": t})["t"]


def _differences(saved: Mapping[str, Any], now: Mapping[str, Any], what: str) -> list[str]:
    keys = sorted(set(saved) | set(now))
    return [
        f"{what} {k!r}: saved {saved.get(k, '<absent>')!r}, now {now.get(k, '<absent>')!r}"
        for k in keys
        if saved.get(k) != now.get(k)
    ]


class LoraBinding:
    """A state item: the base model's identity and the adapter config, compared on restore."""

    def __init__(
        self,
        model: Any,
        base_dir: str | os.PathLike[str],
        *,
        cache_dir: Path | None = None,
        adapter: str = "default",
    ) -> None:
        self.model, self.base_dir, self.cache_dir, self.adapter = (
            model,
            Path(base_dir),
            cache_dir,
            adapter,
        )
        self._identity: dict[str, Any] | None = None
        self._cache: dict[str, Any] = {}

    def identity(self) -> dict[str, Any]:
        if (
            self._identity is None
        ):  # hashed once per process; the cache spares the next process the hashing
            self._identity, self._cache = _identity_and_cache(self.base_dir, self.cache_dir)
            write_cache(self.cache_dir, self._cache)
        return self._identity

    def write_cache(self) -> None:
        """Keep the identity for the next process (a first save computed it before the root
        existed)."""
        if (
            self._cache
            and self.cache_dir is not None
            and not (self.cache_dir / CACHE_NAME).exists()
        ):
            write_cache(self.cache_dir, self._cache)

    def state_dict(self) -> dict[str, Any]:
        return {
            "adapter_name": self.adapter,
            "adapter_config": adapter_config(self.model, self.adapter),
            "base": self.identity(),
        }

    def problems(self, saved: Mapping[str, Any]) -> list[str]:
        """What differs between a saved binding and this model, its base folder and adapter
        config."""
        now = self.state_dict()
        found = _differences(
            saved.get("adapter_config", {}), now["adapter_config"], "adapter config field"
        )
        base_saved, base_now = saved.get("base", {}), now["base"]
        found += [
            f"base {p}"
            for p in _differences(base_saved.get("files", {}), base_now["files"], "file")
        ]
        if not found and base_saved.get("tensors") != base_now["tensors"]:
            found.append(
                "base tensors differ although the files match (a damaged cache): delete "
                f"{CACHE_NAME} in the checkpoint root"
            )
        return found

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        problems = self.problems(saved)
        if problems:
            raise _refusal(problems, self.base_dir, saved)

    def live_problems(self) -> list[str]:
        """Frozen base weights in memory that differ from the base files' (a base merged in
        place)."""
        expected = self.identity()["tensors"]
        bad = []
        for name, param in self.model.named_parameters():
            key = base_name(name)
            if key is None or param.requires_grad or hasattr(param, "placements"):
                continue
            if key in expected and _digest(param.detach()) != expected[key]:
                bad.append(key)
        return bad


def _refusal(problems: list[str], base_dir: Path, saved: Mapping[str, Any]) -> StateMismatchError:
    where = saved.get("base", {}).get("dir", "?")
    return StateMismatchError(
        f"the LoRA checkpoint does not belong to this model: "
        f"{'; '.join(problems[:8])}{' ...' if len(problems) > 8 else ''}. It was saved on the base "
        f"at {where}, with the adapter config recorded in it; this run has the base at {base_dir}. "
        f"Load the same base and adapter config (or start a new run for the new ones)"
    )


def read_binding(step_dir: Path) -> dict[str, Any] | None:
    """The binding a step recorded (rank 0's extras, read with weights_only=True), or None."""
    extras = torch.load(step_dir / _layout.extras_name(0), weights_only=True, map_location="cpu")
    items = extras.get("items", {}) if isinstance(extras, dict) else {}
    binding = items.get(BINDING_ITEM)
    return binding if isinstance(binding, dict) and "base" in binding else None


# ---------------------------------------------------------------- the front door


class LoraCheckpoint:
    """Adapter-only saves of a peft model through ``manager``, restores refused on another base or
    config."""

    def __init__(
        self,
        manager: Any,
        model: Any,
        optim: torch.optim.Optimizer,
        *,
        base_dir: str | os.PathLike[str],
        adapter: str = "default",
    ) -> None:
        self.manager, self.model, self.optim = manager, model, optim
        self.binding = LoraBinding(model, base_dir, cache_dir=Path(manager.root), adapter=adapter)
        self.adapter = AdapterModule(model)

    def state(self) -> MutableMapping[str, Any]:
        return {ADAPTER_ITEM: self.adapter, OPTIM_ITEM: self.optim, BINDING_ITEM: self.binding}

    def save(self, step: int, **kwargs: Any) -> Any:
        committed = self.manager.save(step, self.state(), **kwargs)
        self.binding.write_cache()
        return committed

    def restore(self, **kwargs: Any) -> int:
        """Restore the adapter and its optimizer; refused, before a tensor is read, on another base
        or config."""
        resolution = self.manager.resolve(**kwargs)
        if resolution.path is not None:
            saved = read_binding(resolution.path)
            if saved is None:
                raise StateMismatchError(
                    f"{resolution.path} holds no LoRA binding: it was not saved by "
                    "LoraCheckpoint; restore it with the manager"
                )
            problems = self.binding.problems(saved)
            if problems:
                raise _refusal(problems, self.binding.base_dir, saved)
        step: int = self.manager.restore(self.state(), **kwargs)
        bad = self.binding.live_problems()
        if bad:
            raise StateMismatchError(
                f"the model's base weights in memory differ from the base files at "
                f"{self.binding.base_dir} for {bad[:6]}{' ...' if len(bad) > 6 else ''}: an "
                f"adapter was merged into them (or they were changed); rebuild the model from the "
                f"base files before restoring the adapter"
            )
        return step


# ---------------------------------------------------------------- merged weights for a rollout
# engine


class LoraFactors:
    """One LoRA-targeted weight: the base weight, its adapter factors and scaling (float64 checks
    use them)."""

    def __init__(
        self,
        name: str,
        base: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        scaling: float,
        fan_in_fan_out: bool,
    ) -> None:
        self.name, self.base, self.a, self.b = name, base, a, b
        self.scaling, self.fan_in_fan_out = float(scaling), bool(fan_in_fan_out)

    def delta64(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(delta @ x, |delta| @ |x|)`` bound, in float64, from the factors (never from a merged
        weight)."""
        a, b, xa = self.a.double(), self.b.double(), x.double()
        if self.fan_in_fan_out:  # delta = (B @ A).T
            return (a.T @ (b.T @ xa)) * self.scaling, (
                a.abs().T @ (b.abs().T @ xa.abs())
            ) * self.scaling
        return (b @ (a @ xa)) * self.scaling, (b.abs() @ (a.abs() @ xa.abs())) * self.scaling


def is_peft_model(obj: Any) -> bool:
    """A peft model (it has ``peft_config`` and the base model under it)."""
    return isinstance(getattr(obj, "peft_config", None), Mapping) and callable(
        getattr(obj, "get_base_model", None)
    )


def _lora_modules(model: Any, adapter: str) -> list[tuple[str, Any]]:
    """``[(base weight name, peft LoRA layer)]`` of the adapter; DoRA and LoRA biases refused,
    naming the layer."""
    if not is_peft_model(model):
        raise ConfigError(
            "expected a peft model (peft.get_peft_model(...)); got "
            f"{type(model).__name__}, which has no peft_config"
        )
    if adapter not in model.peft_config:
        raise ConfigError(
            f"the peft model has no adapter {adapter!r} (it has {sorted(model.peft_config)})"
        )
    base = model.get_base_model()
    out = []
    for mname, module in base.named_modules():
        if (
            not (hasattr(module, "lora_A") and hasattr(module, "base_layer"))
            or adapter not in module.lora_A
        ):
            continue
        if getattr(module, "use_dora", {}).get(adapter, False) or getattr(
            module, "lora_bias", {}
        ).get(adapter, False):
            raise ConfigError(
                f"LoRA layer {mname!r} uses DoRA or a LoRA bias: only plain LoRA merges are pushed "
                "and checked"
            )
        if not hasattr(module.base_layer, "weight") or not hasattr(
            module.lora_A[adapter], "weight"
        ):
            raise ConfigError(
                f"LoRA layer {mname!r} is not a Linear LoRA layer: only Linear layers are checked"
            )
        out.append((f"{mname}.weight", module))
    if not out:
        raise ConfigError(
            f"the peft model's adapter {adapter!r} has no LoRA layer: nothing to merge"
        )
    return out


def lora_factors(model: Any, adapter: str = "default") -> dict[str, LoraFactors]:
    """``{base weight name: LoraFactors}`` of every LoRA layer of ``adapter`` (names as the base
    model's)."""
    out = {}
    for name, module in _lora_modules(model, adapter):
        out[name] = LoraFactors(
            name,
            module.base_layer.weight.detach(),
            module.lora_A[adapter].weight.detach(),
            module.lora_B[adapter].weight.detach(),
            module.scaling[adapter],
            bool(getattr(module, "fan_in_fan_out", False)),
        )
    return out


def merged_state(
    model: Any, adapter: str = "default", *, binding: LoraBinding | None = None
) -> dict[str, torch.Tensor]:
    """The base model's state with the adapter merged exactly once, out of place (see the module
    doc).

    Keys are the base model's (``model.layers.0.self_attn.q_proj.weight``); tied weights keep
    sharing storage. Refused, naming the layers, when the adapter is merged already
    (``merge_adapter`` was called and not undone: unmerge first); with ``binding``, when the
    in-memory base differs from the base files."""
    modules = _lora_modules(model, adapter)
    merged_now = [n for n, m in modules if getattr(m, "merged", False)]
    if merged_now:
        raise StateMismatchError(
            f"the adapter {adapter!r} is merged into the base weights already "
            f"({merged_now[:4]}{' ...' if len(merged_now) > 4 else ''}): merging it for the push "
            f"would add its delta twice. Call model.unmerge_adapter() before the push "
            f"(merged_state merges, out of place, once)"
        )
    if binding is not None:
        bad = binding.live_problems()
        if bad:
            raise StateMismatchError(
                f"the model's base weights in memory differ from the base files at "
                f"{binding.base_dir} for {bad[:6]}{' ...' if len(bad) > 6 else ''}: an adapter "
                f"is merged into them already (a merge whose flag was lost, e.g. a model "
                f"rebuilt from a merged export); pushing base + adapter would merge it twice. "
                f"Rebuild the model from the base files"
            )
    state: dict[str, torch.Tensor] = {}
    targets = {name: module for name, module in modules}
    by_storage: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
    with torch.no_grad():
        for key, t in model.get_base_model().state_dict().items():
            if ".lora_" in key:
                continue
            name = key.replace(".base_layer.", ".")
            module = targets.get(name)
            if module is not None:
                state[name] = t.detach().clone() + module.get_delta_weight(
                    adapter
                )  # peft's merge, out of place
            else:
                # tied weights (an embedding used as the head) keep one storage: the engine folds
                # the alias
                ident = (t.data_ptr(), tuple(t.shape))
                state[name] = by_storage.setdefault(ident, t.detach())
    return state


def merge_count(
    factors: Mapping[str, LoraFactors],
    products: Mapping[str, torch.Tensor],
    probes: Mapping[str, torch.Tensor],
    eps: float,
) -> dict[str, float | None]:
    """How many times each adapter's delta is in the held weight ``W_e`` (1.0: merged once).

    ``products[name]`` is ``W_e @ probes[name]`` in float64, computed where ``W_e`` lives (the
    engine's worker); the base ``W`` and the factors are the actor's. ``eps``: the held weight's
    dtype's epsilon. None: the delta is zero (an untrained LoRA B), so no count is observable. A
    weight whose residual exceeds one rounding of ``W + delta`` for any count is reported as its
    least-squares count."""
    out: dict[str, float | None] = {}
    for name, f in factors.items():
        x = probes[name].double()
        d, d_size = f.delta64(x)
        w = f.base.double()
        got = products[name].double() - w @ x
        if float(d.abs().max()) == 0.0:
            out[name] = None if float(got.abs().max()) == 0.0 else float("inf")
            continue
        times = float((got * d).sum() / (d * d).sum())
        tol = eps * ((w.abs() @ x.abs()) + 2 * d_size) + 4 * f.a.shape[0] * eps * d_size
        out[name] = 1.0 if bool(((got - d).abs() <= tol + 1e-30).all()) else times
    return out


# ---------------------------------------------------------------- the export's adapter probe
# (prove's evidence)


PROBE_POINTS = 8
"""Entries of each LoRA-targeted weight sampled into an export record: enough for a least-squares
multiple of the delta, small enough that a record never holds a tensor (3 x 8 numbers per
weight)."""

Probe = dict[str, dict[str, Any]]


def _points(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The flat positions sampled of weight ``name``: a hash of its name, shape and the point's
    index only (no RNG whose algorithm a torch upgrade may change), so every run, the saving one and
    each resume, samples the same entries whatever its process, device or library version."""
    numel = 1
    for n in shape:
        numel *= int(n)
    key = f"ckptguard.adapter_probe|{name}|{list(shape)}"
    return torch.tensor(
        [
            xxhash.xxh3_64_intdigest(f"{key}|{i}".encode()) % max(numel, 1)
            for i in range(min(PROBE_POINTS, numel))
        ],
        dtype=torch.int64,
    )


def _values(t: torch.Tensor, at: torch.Tensor) -> list[float | None]:
    picked = t.detach().reshape(-1)[at.to(t.device)].double().cpu().tolist()
    return [v if v == v and abs(v) != float("inf") else None for v in picked]  # JSON has no NaN


def _peft_pairs(model: Any, adapter: str) -> dict[str, tuple[torch.Tensor, Any]]:
    """``{base weight name: (base weight, factors)}``: the delta is sampled from the factors, never
    built whole."""
    return {n: (f.base, f) for n, f in lora_factors(model, adapter).items()}


def _delta_at(delta: Any, shape: tuple[int, ...], at: torch.Tensor) -> list[float | None]:
    if isinstance(delta, torch.Tensor):
        return _values(delta, at)
    f: LoraFactors = (
        delta  # entry (i, j) of scaling * B @ A (transposed for fan_in_fan_out), in float64
    )
    cols = int(shape[1])
    i, j = (at // cols).tolist(), (at % cols).tolist()
    a, b = f.a.detach().double().cpu(), f.b.detach().double().cpu()
    if f.fan_in_fan_out:
        i, j = j, i
    return [float(b[r] @ a[:, c]) * f.scaling for r, c in zip(i, j, strict=True)]


def adapter_probe(
    payload: Any,
    adapter: Any,
    *,
    adapter_name: str = "default",
    names: Callable[[str], str] | None = None,
) -> Probe:
    """What ``prove`` needs to say how many times a LoRA delta is in an exported weight: for each
    targeted weight, ``PROBE_POINTS`` sampled entries of its base (``base``), of the delta
    (``delta``) and, where ``payload`` maps the weight's name to a tensor, of what was exported
    (``sent``), with the base's dtype epsilon (``eps``).

    ``adapter``: a peft model (its LoRA layers: base weight and factors, names as the base model's)
    or, for an adapter declared by hand, ``{name: (base, delta)}`` with tensors of one shape.
    ``names``: the export's name of a base model's weight (an engine's name map). ConfigError for a
    hand-declared pair that does not fit. A sharded (DTensor) weight is left out: prove then names
    its tensor, not the multiple."""
    pairs: dict[str, tuple[torch.Tensor, Any]]
    if is_peft_model(adapter):
        pairs = _peft_pairs(adapter, adapter_name)
    elif isinstance(adapter, Mapping):
        pairs = {}
        for name, pair in adapter.items():
            ok = (
                isinstance(pair, (tuple, list))
                and len(pair) == 2
                and all(isinstance(t, torch.Tensor) for t in pair)
            )
            if not ok or tuple(pair[0].shape) != tuple(pair[1].shape):
                raise ConfigError(
                    f"adapter_probe: {name!r} must map to (base, delta), two tensors of "
                    "one shape (the delta is what the adapter adds to the base weight)"
                )
            pairs[str(name)] = (pair[0], pair[1])
    else:
        raise ConfigError(
            f"adapter_probe: the adapter is a peft model or {{name: (base, delta)}}; got "
            f"{type(adapter).__name__}"
        )
    sent = payload if isinstance(payload, Mapping) else {}
    out: Probe = {}
    for name, (base, delta) in pairs.items():
        key = names(name) if names is not None else name
        if any(hasattr(t, "placements") for t in (base, delta, sent.get(key))):
            # a DTensor's entries live on other ranks: reading them is a collective not every rank
            # makes
            continue
        shape = tuple(base.shape)
        at = _points(key, shape)
        entry: dict[str, Any] = {
            "base": _values(base, at),
            "delta": _delta_at(delta, shape, at),
            "eps": torch.finfo(base.dtype).eps if base.dtype.is_floating_point else 0.0,
        }
        held = sent.get(key)
        if isinstance(held, torch.Tensor) and tuple(held.shape) == shape:
            entry["sent"] = _values(held, at)
        out[key] = entry
    return out
