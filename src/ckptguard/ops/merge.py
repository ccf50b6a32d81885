"""``ckptguard export --merged``: a LoRA step's base + adapter as one Hugging Face model, merged
exactly once.

Contract: for a step saved by ``integrations.peft.LoraCheckpoint``, every tensor of the base model's
safetensors files (the folder the step's binding names) is read, checked against the base identity
the step recorded (a base whose weights changed since the save, e.g. one with an adapter already
merged into it, is refused naming the tensor), and written under its own name; a tensor that the
adapter targets is written as ``W + (B @ A) * scaling`` (transposed for ``fan_in_fan_out``),
computed as peft's own merge computes it. Each merged tensor is then checked against a merge
computed independently, in float64 from the checked adapter tensors: ``merged - W`` must be that
delta within the rounding of one addition in the weight's dtype, so a delta added twice (or not at
all) is refused before anything is published. The adapter tensors are checked against the step's
layout-free digests. Files, read-back checks and the atomic publish are ``ops.export``'s.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
import xxhash

from .._records import manifest as _manifest
from ..errors import CheckpointCorruptError, ConfigError
from ..integrations import peft as _peft
from ..storage import StorageContext, StreamingStorage, read_dcp_metadata
from . import export as _export
from . import hffiles as _files

__all__ = ["export_merged", "merge_delta"]

_CHECK_ROWS_ELEMENTS = 1 << 20  # elements of one float64 block of the independent check


def _lora_config(binding: dict[str, Any], step_dir: Path) -> tuple[float, bool]:
    """(scaling, fan_in_fan_out) of a plain LoRA adapter; anything else refused, naming the
    field."""
    config = binding["adapter_config"]
    unsupported = {
        "use_dora": False,
        "lora_bias": False,
        "bias": "none",
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    bad = [f"{k}={config.get(k)!r}" for k, v in unsupported.items() if config.get(k, v) != v]
    if config.get("peft_type") != "LORA" or bad:
        raise ConfigError(
            f"{step_dir}: export --merged merges plain LoRA adapters only; this one has "
            f"{', '.join(bad) or 'peft_type=' + repr(config.get('peft_type'))}"
        )
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return scaling, bool(config.get("fan_in_fan_out"))


def _adapter(
    step_dir: Path, manifest: _manifest.Manifest, adapter: str
) -> dict[str, dict[str, torch.Tensor]]:
    """``{base tensor name: {"A", "B"}}``: the step's adapter tensors, each checked against its
    layout-free digest."""
    expected = (manifest.layout_free or {}).get(_peft.ADAPTER_ITEM)
    if not expected:
        raise CheckpointCorruptError(
            f"{step_dir}: no layout-free digests of item {_peft.ADAPTER_ITEM!r}: cannot "
            "check the adapter"
        )
    md = read_dcp_metadata(step_dir / "state")
    tensors = {}
    for key in expected:
        meta = md.state_dict_metadata[key]
        size, dtype = meta.size, meta.properties.dtype  # type: ignore[union-attr]
        tensors[key] = torch.empty(tuple(size), dtype=dtype)
    StreamingStorage().read(
        step_dir / "state", tensors, StorageContext(rank=0, world_size=1, process_group=None)
    )
    now = _files.digests(tensors)
    bad = sorted(k for k in expected if now[k] != expected[k])
    if bad:
        raise CheckpointCorruptError(
            f"{step_dir}/state: adapter keys {bad[:4]} read back with other layout-free "
            "digests than the save recorded: run `ckptguard verify --deep` on the step"
        )
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name = _peft.original_name(key[len(_peft.ADAPTER_ITEM) + 1 :])
        for part in ("A", "B"):
            marker = f".lora_{part}.{adapter}."
            if marker in name:
                module = name.removeprefix("base_model.model.").split(marker)[0]
                out.setdefault(f"{module}.weight", {})[part] = t
    incomplete = sorted(n for n, ab in out.items() if set(ab) != {"A", "B"})
    if incomplete:
        raise CheckpointCorruptError(
            f"{step_dir}: adapter of {incomplete[:4]} lacks lora_A or lora_B"
        )
    return out


def merge_delta(
    w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, fan_in_fan_out: bool
) -> None:
    """``w += (B @ A) * scaling`` in place, as peft's ``Linear.merge`` does
    (``get_delta_weight``)."""
    cast = a.dtype in (
        torch.float16,
        torch.bfloat16,
    )  # peft computes a half-precision delta in fp32 on the CPU
    wa, wb = (a.float(), b.float()) if cast else (a, b)
    delta = wb @ wa
    if fan_in_fan_out:
        delta = delta.T
    delta = delta * scaling
    w += delta.to(a.dtype) if cast else delta


def _check_merge(
    name: str,
    merged: torch.Tensor,
    base: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: float,
    fan_in_fan_out: bool,
) -> None:
    """``merged - base`` equals the adapter's delta, computed again in float64, within one
    rounding."""
    eps_w = torch.finfo(merged.dtype).eps
    eps_a = torch.finfo(a.dtype).eps
    a64, b64 = a.double(), b.double()
    rows = merged.shape[0]
    step = max(1, _CHECK_ROWS_ELEMENTS // max(1, merged[0].numel()))
    for r in range(0, rows, step):
        block = slice(r, min(rows, r + step))
        if fan_in_fan_out:  # delta = (B @ A).T: its rows are A's columns
            delta = (b64 @ a64[:, block]).T * scaling
            size = (b64.abs() @ a64[:, block].abs()).T * scaling
        else:
            delta = (b64[block] @ a64) * scaling
            size = (b64[block].abs() @ a64.abs()) * scaling
        got = merged[block].double() - base[block].double()
        tol = (
            eps_w * (merged[block].double().abs() + base[block].double().abs())
            + 4 * a.shape[0] * eps_a * size
        )
        if bool(((got - delta).abs() > tol + 1e-30).any()):
            times = float((got * delta).sum() / (delta * delta).sum().clamp_min(1e-300))
            how = (
                "twice or more" if times > 1.5 else "not at all" if abs(times) < 0.5 else "wrongly"
            )
            raise CheckpointCorruptError(
                f"merged tensor {name!r}: merged - base is {times:.2f} x the adapter's delta, not "
                f"1 x (checked in float64 against the step's adapter): the adapter was merged "
                f"{how}; nothing was published"
            )


def export_merged(
    step_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    max_host_bytes: int = _export.DEFAULT_BUDGET,
    progress: _export.Progress | None = None,
) -> _export.ExportResult:
    """Export the LoRA step ``step_dir`` as its base model with the adapter merged once (module
    docstring)."""
    step_dir, out = Path(os.fspath(step_dir)), Path(os.fspath(out))
    manifest = _manifest.read(step_dir)
    binding = _peft.read_binding(step_dir)
    if binding is None:
        raise ConfigError(
            f"{step_dir} holds no LoRA binding (item {_peft.BINDING_ITEM!r}): --merged exports "
            f"steps saved by ckptguard.integrations.peft.LoraCheckpoint; export it without --merged"
        )
    scaling, fan = _lora_config(binding, step_dir)
    base_dir = Path(binding["base"]["dir"])
    recorded = binding["base"]["tensors"]
    adapter = _adapter(step_dir, manifest, str(binding.get("adapter_name", "default")))
    planned, where = _plan(base_dir, recorded, adapter, dtype)
    missing = sorted(set(adapter) - set(where))
    if missing:
        raise CheckpointCorruptError(
            f"the adapter targets {missing[:4]}, which the base at {base_dir} lacks"
        )

    def fill(p: _export.Planned, target: torch.Tensor) -> None:
        for _name, _t in _files.read_tensors(where[p.name], [p.name], into={p.name: target}):
            pass
        if _files.digests({p.name: target})[p.name] != recorded[p.name]:
            raise CheckpointCorruptError(
                f"{where[p.name]}: base tensor {p.name!r} differs from the base step "
                f"{manifest.step} was trained on (its identity is in the step): the base files "
                f"changed since, e.g. an adapter was merged into them. Nothing was exported; point "
                f"the export at the original base"
            )
        ab = adapter.get(p.name)
        if ab is not None:
            base = target.clone()
            merge_delta(target, ab["A"], ab["B"], scaling, fan)
            _check_merge(p.name, target, base, ab["A"], ab["B"], scaling, fan)

    def configs(tmp: Path) -> list[str]:
        return _base_configs(step_dir, manifest, base_dir, binding, tmp, dtype)

    extra = {
        "merged": {
            "base": {"dir": str(base_dir), "files": binding["base"]["files"]},
            "scaling": scaling,
            "adapter_config": binding["adapter_config"],
            "merged_tensors": sorted(adapter),
        }
    }
    source = _export.source_of(step_dir, manifest, _peft.ADAPTER_ITEM)
    return _export.publish(
        out,
        planned,
        fill,
        source,
        configs,
        dtype=dtype,
        max_host_bytes=max_host_bytes,
        progress=progress,
        extra=extra,
    )


def _plan(
    base_dir: Path, recorded: dict[str, str], adapter: dict[str, Any], dtype: torch.dtype | None
) -> tuple[list[_export.Planned], dict[str, Path]]:
    planned, where = [], {}
    for path in sorted(base_dir.glob("*.safetensors")):
        _start, header = _files.read_header(path)
        for name, info in sorted(header.items()):
            if name == "__metadata__":
                continue
            if name not in recorded:
                raise CheckpointCorruptError(
                    f"{path}: tensor {name!r} is not in the base identity the step recorded"
                )
            src = _files.ST_DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            out = dtype if dtype is not None and src.is_floating_point else src
            p = _export.Planned(
                name,
                shape,
                src,
                out,
                (_export.Source(f"base:{path.name}:{name}", recorded[name], shape),),
            )
            if name in adapter:
                # the base weight's copy, and one float64 block of the independent check (six
                # arrays)
                extra = p.src_bytes + 48 * min(p.numel, _CHECK_ROWS_ELEMENTS)
                p = _export.Planned(name, shape, src, out, p.sources, extra_bytes=extra)
            planned.append(p)
            where[name] = path
    return planned, where


def _base_configs(
    step_dir: Path,
    manifest: _manifest.Manifest,
    base_dir: Path,
    binding: dict[str, Any],
    tmp: Path,
    dtype: torch.dtype | None,
) -> list[str]:
    """The step's own config/tokenizer files; else the base's config.json, checked against the
    binding."""
    copied = _export.copy_configs(step_dir, manifest, tmp, dtype)
    if "config.json" not in copied and (base_dir / "config.json").exists():
        data = (base_dir / "config.json").read_bytes()
        size, xxh3 = binding["base"]["files"].get("config.json", [None, None])
        if len(data) != size or xxhash.xxh3_64(data).hexdigest() != xxh3:
            raise CheckpointCorruptError(
                f"{base_dir / 'config.json'} changed since the step was saved"
            )
        (tmp / "config.json").write_bytes(
            data if dtype is None else _export.retyped_config(base_dir, data, dtype)
        )
        copied.append("config.json")
    return copied
