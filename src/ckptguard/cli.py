"""The ckptguard command line: a thin layer over the public API.

Exit codes: 0 success, 1 the check failed (or the checkpoint refused), 2 bad usage.
Every command runs inside one error mapping (``_mapped``): whatever a command meets on
disk (a malformed manifest, tracker, proof record or extras file, a full filesystem)
ends in one ``error:`` line (a JSON ``{"error": ...}`` under ``--json``) and exit 1, or
exit 2 for a bad argument; never a traceback. ``CKPTGUARD_DEBUG=1`` re-raises instead,
for a bug report.
"""

from __future__ import annotations

import errno as _errno
import importlib
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from . import __version__
from .config import ResumeMode
from .errors import CheckpointError, ConfigError
from .ops import inspect as _inspect
from .ops.verify import Cost, printable

if TYPE_CHECKING:
    from .ops.gc import GcReport


def _json_out(ok: bool, **fields: Any) -> None:
    """The one JSON style of every command: one object on stdout, ``ok`` first, and on a failure
    ``error`` (what went wrong, where, what to do); the command's own fields beside them."""
    click.echo(json.dumps({"ok": ok, **fields}))


def _progress(length: int, label: str, as_json: bool = False) -> Any:
    """A progress bar on stderr for long work, shown only on a terminal (never under --json, in a
    pipe or a log file): click's, the library the CLI is written in (no further dependency)."""
    shown = not as_json and sys.stderr.isatty()
    return click.progressbar(
        length=max(length, 1),
        label=label,
        file=sys.stderr,
        hidden=not shown,
        show_pos=False,
        show_percent=True,
    )


_OS_HINTS = {
    _errno.ENOSPC: "the filesystem is full: free space there (or pick another "
    "destination) and retry; "
    "ckptguard publishes nothing half-written",
    _errno.EDQUOT: "the disk quota is exhausted: free space or raise the quota, then retry",
    _errno.EROFS: "the filesystem is mounted read-only",
    _errno.EACCES: "check the permissions of that path",
    _errno.EPERM: "check the permissions of that path",
    _errno.ENOENT: "check the path",
    _errno.EIO: "the storage reported an I/O error: check the device, then "
    "`ckptguard verify --deep`",
}


def _os_message(exc: OSError) -> str:
    name = _errno.errorcode.get(exc.errno or 0, "")
    where = f"{exc.filename}: " if exc.filename else ""
    hint = _OS_HINTS.get(exc.errno or 0, "")
    return f"{where}{exc.strerror or exc} (errno {exc.errno} {name})" + (
        f"; {hint}" if hint else ""
    )


def _mapped(call: Callable[[], Any], as_json: bool) -> Any:
    """Run a command; map every error it raises to one clear message and an exit code."""
    try:
        return call()
    except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
        raise
    except Exception as exc:
        if os.environ.get("CKPTGUARD_DEBUG"):
            raise
        if isinstance(exc, ConfigError):
            _fail(str(exc), as_json, code=2)
        if isinstance(exc, CheckpointError):
            _fail(str(exc), as_json)
        if isinstance(exc, OSError):
            _fail(_os_message(exc), as_json)
        if isinstance(
            exc,
            (
                RecursionError,
                UnicodeError,
                KeyError,
                TypeError,
                ValueError,
                AttributeError,
                IndexError,
                EOFError,
            ),
        ):
            _fail(
                f"malformed input ({type(exc).__name__}: {str(exc)[:300]}); a file this command "
                f"read is not what ckptguard writes: run `ckptguard verify` on the root, and set "
                f"CKPTGUARD_DEBUG=1 for the traceback if you think the file is fine",
                as_json,
            )
        _fail(
            f"unexpected {type(exc).__name__}: {str(exc)[:300]}; this is a bug in ckptguard: rerun "
            f"with CKPTGUARD_DEBUG=1 and report the traceback",
            as_json,
        )


class _Command(click.Command):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Bad usage under ``--json`` (a path that does not exist, an unknown option) is one JSON
        object on stdout too, exit 2, as every other failure of a command a script reads."""
        given = list(args)  # click's parser consumes the list it is given
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            if "--json" not in given:
                raise
            _fail(
                f"{exc.format_message()} (`ckptguard {ctx.info_name} --help` says what it takes)",
                True,
                code=2,
            )

    def invoke(self, ctx: click.Context) -> Any:
        return _mapped(lambda: super(_Command, self).invoke(ctx), bool(ctx.params.get("as_json")))


class _Group(click.Group):
    """Commands made with ``@main.command`` map their errors themselves (they know ``--json``);
    the group maps what escapes from the others (``mem ...``) too.

    A group defined in another module (``mem``) is imported only when it is run or its own help
    is asked for; ``ckptguard --help`` lists it from the help line kept here."""

    command_class = _Command
    lazy: dict[str, tuple[str, str, str]] = {  # name: (module, attribute, the group's help line)
        "mem": (
            "ckptguard.memory.cli",
            "mem",
            "Host and GPU memory budget: phase records, growth, capacity plan, report.",
        ),
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(self.commands) | set(self.lazy))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy and cmd_name not in self.commands:
            module, attr, _ = self.lazy[cmd_name]
            self.add_command(getattr(importlib.import_module(module), attr), cmd_name)
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        limit = formatter.width - 6 - max(len(n) for n in self.list_commands(ctx))
        rows: list[tuple[str, str]] = []
        for name in self.list_commands(ctx):
            cmd = self.commands.get(name)
            if (
                cmd is None
            ):  # the help line of a group not imported yet (a test keeps it the group's own)
                rows.append(
                    (name, click.Command(name, help=self.lazy[name][2]).get_short_help_str(limit))
                )
            elif not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx: click.Context) -> Any:
        return _mapped(lambda: super(_Group, self).invoke(ctx), False)


# The commands' modules are imported when a command runs, or are torch-free: ``ckptguard --help``,
# ``list``, ``resolve``, ``status``, ``preflight``, ``hold``, ``release``, ``gc``, ``adopt`` and
# ``goodput`` start without torch (1-2 s of CPU alone, 20-60 s on the loaded node an operator is on
# during an incident). tests/cli/test_cli_start.py holds that line; benchmarks/bench_cli_start.py
# measures it.


class _Local(click.Path):
    """A local path; an object-store URL is refused by name (never taken as a local path named
    ``s3:``)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and value[:3].lower() == "s3:" and not value.startswith("s3://"):
            self.fail(
                f"{value!r} reads like an object-store URL but is not one: write "
                f"s3://bucket/prefix (lower-case scheme, two slashes)",
                param,
                ctx,
            )
        if isinstance(value, str) and "://" in value:
            command = ctx.info_name if ctx is not None else "this command"
            self.fail(
                f"{value}: `ckptguard {command}` works on local paths only; on "
                f"object-store roots (s3://) ckptguard runs list, verify, preflight, gc, "
                f"transfer and prove (docs/objectstore.md)",
                param,
                ctx,
            )
        return super().convert(value, param, ctx)


TEMPLATE = click.option(
    "--template",
    default="step_{step:08d}",
    show_default=True,
    help="Step directory name template (verl: 'global_step_{step}').",
)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckptguard")
def main() -> None:
    """Checkpoints that commit atomically across ranks, and resumes that are proven.

    Run `ckptguard demo` to watch a training job get killed, resume and be proven exact.
    """


@main.command()
@click.argument("root", type=_Local(path_type=Path))
@click.option(
    "--mode",
    type=click.Choice([m.value for m in ResumeMode]),
    default="auto",
    show_default=True,
    help="auto: the tracker's step; must: fail instead of starting fresh; never: start fresh.",
)
@click.option(
    "--path", "path", type=_Local(path_type=Path), help="Resolve this step directory instead."
)
@click.option(
    "--prefer",
    type=click.Choice(["latest", "verified"]),
    default="latest",
    show_default=True,
    help="latest: the tracker's step; verified: the newest verified step "
    "(restore(prefer='verified')).",
)
@TEMPLATE
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def resolve(
    root: Path, mode: str, path: Path | None, prefer: str, template: str, as_json: bool
) -> None:
    """Say which step a restore under ROOT would load, and why, without loading it.

    Exit 0 with the decision; exit 1 if a restore would refuse (and why).
    """
    try:
        res = _inspect.resolve(root, template, ResumeMode(mode), path, prefer)
    except CheckpointError as exc:
        _fail(str(exc), as_json)
    if as_json:
        _json_out(
            True,
            step=res.step,
            path=str(res.path) if res.path else None,
            fresh=res.fresh,
            reason=res.reason,
        )
    else:
        click.echo(printable(res.describe()))


class _RootOrURL(click.ParamType):  # type: ignore[type-arg]
    """An existing directory (``exists=False``: any local path), or an object-store root
    ``s3://bucket/prefix`` (checked when read)."""

    name = "ROOT"

    def __init__(self, *, exists: bool = True) -> None:
        self.exists = exists

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and value.startswith("s3://"):
            return value
        return _Local(path_type=Path, exists=self.exists, file_okay=False).convert(
            value, param, ctx
        )


def _list_remote(url: str, template: str, as_json: bool) -> None:
    from .ops import remote as _remote

    listing = _remote.list_remote(url, template)
    if as_json:
        entries = [{"step": e.step, "state": e.state, "name": e.name} for e in listing.entries]
        _json_out(True, tracker=listing.tracker, entries=entries)
        return
    click.echo(f"tracker: {listing.tracker if listing.tracker is not None else 'absent'}")
    for e in listing.entries:
        click.echo(printable(f"{e.step:>10}  {e.state}  {e.name}"))


@main.command(name="list")
@click.argument("root", type=_RootOrURL())
@TEMPLATE
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def list_steps(root: Path | str, template: str, as_json: bool) -> None:
    """List the step directories under ROOT, whether each is committed, its trust state
    (candidate, or verified after enough healthy later steps) and its hold (`ckptguard hold`:
    rotation and gc keep it), with the hold's reason. ROOT may be s3://bucket/prefix
    (endpoint and credentials from boto3's configuration, e.g. AWS_ENDPOINT_URL)."""
    if isinstance(root, str):
        return _list_remote(root, template, as_json)
    listing = _inspect.list_steps(root, template)
    if as_json:
        entries = [
            {"step": e.step, "state": e.state, "name": e.name, "trust": e.trust, "held": e.held}
            for e in listing.entries
        ]
        _json_out(True, tracker=listing.tracker, entries=entries)
        return
    click.echo(f"tracker: {listing.tracker if listing.tracker is not None else 'absent'}")
    for e in listing.entries:
        trust = f"  [{e.trust}]" if e.trust else ""
        held = f"  [held: {e.held}]" if e.held else ""
        click.echo(
            printable(
                f"{e.step if e.step is not None else '-':>10}  {e.state}  {e.name}{trust}{held}"
            )
        )


def _size(n: float) -> str:
    """Bytes in the largest unit that keeps the figure at least 1 (``512 B``, ``19.4 KiB``, ``4
    GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return (
                f"{n:.0f} {unit}"
                if unit == "B"
                else f"{n:.3g} {unit}"
                if n < 100
                else f"{n:.0f} {unit}"
            )
        n /= 1024
    return f"{n:.3g} TiB" if n < 100 else f"{n:.0f} TiB"


def _cost_line(c: Cost) -> str:
    frac, secs = c.save_fraction_of_step, c.step_seconds
    step = (
        f", {100 * frac:.1f}% of a {secs:.2f} s step"
        if frac is not None and secs is not None
        else ""
    )
    said = {
        "skipped": "skipped before it",
        "coalesced": "coalesced before it (replaced in the queue)",
        "redirected": "redirected to the fast tier, it included if it is one",
    }
    busy = "".join(
        f", {n} save(s) {v} (a commit in flight)"
        for k, v in said.items()
        if isinstance(n := c.figure(f"{k}_saves"), int) and n
    )
    return f"{_size(c.bytes)}, saved in {c.save_seconds or 0.0:.2f} s{step}{busy}"


def _emit(findings: list[Any], as_json: bool, extra: dict[str, Any] | None = None) -> None:
    if as_json:
        ok = not any(f.severity.value == "ERROR" for f in findings)
        click.echo(
            json.dumps({**(extra or {}), "ok": ok, "findings": [f.to_json() for f in findings]})
        )
    else:
        for f in findings:
            click.echo(f.line())  # escaped: a file name cannot forge a line


@main.command()
@click.argument("path", type=_RootOrURL())
@click.option(
    "--deep", is_flag=True, help="Also check every file's xxh3 checksum (reads every byte)."
)
@click.option(
    "--restore",
    "do_restore",
    is_flag=True,
    help="Also restore in a new process from the checkpoint's own metadata and compare digests.",
)
@TEMPLATE
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def verify(path: Path | str, deep: bool, do_restore: bool, template: str, as_json: bool) -> None:
    """Check that PATH (a step directory, or a root: every committed step) is complete.

    PATH may be an object-store root s3://bucket/prefix: every committed step's objects against
    its marker (--deep: downloaded and checksummed; --restore is for local roots).
    Exit 0 complete, 1 incomplete or corrupt, 2 bad usage. One line per finding:
    severity, code, file, what is wrong and what to do.
    """
    from .ops import verify as _verify

    if isinstance(path, str):
        return _verify_remote(path, deep, do_restore, template, as_json)

    path = path.absolute()
    if _is_export(path):
        _verify_export(path, deep, as_json)
    naming = _inspect.naming(template)
    is_root, candidates = _inspect.verify_targets(path, template)
    # Progress on a terminal: bytes hashed with --deep, else steps checked.
    total = sum(_verify.deep_bytes(p) for p in candidates) if deep else len(candidates)
    with _progress(total, "checksums" if deep else "verify", as_json) as bar:

        def step_done(step_dir: Path) -> None:
            bar.label = f"verify {step_dir.name}"
            if not deep:
                bar.update(1)

        if is_root:
            steps, findings = _verify.verify_root(
                path, naming, deep=deep, progress=bar.update, on_step=step_done
            )
        else:
            steps, findings = [path], _verify.verify_step(path, deep=deep, progress=bar.update)
        bar.update(
            bar.length - bar.pos
        )  # done: orphans and links counted in the total were not hashed
    tensors: dict[str, Any] = {}
    if deep and not _verify.worst(
        findings
    ):  # what restore compares: each tensor against its layout-free digest
        for p in steps:
            check = _verify.tensor_findings(p)
            findings += check.findings
            tensors[str(p)] = check.to_json()
    restored = do_restore and not _verify.worst(findings) and bool(steps)
    if restored:
        findings += _restore_with_progress(_verify, steps, as_json)
    costs = {str(p): _verify.cost(p) for p in steps}
    costs_json = {k: c.to_json() if c else None for k, c in costs.items()}
    # What was compared, said plainly: checksums compare the files with the manifest, so a file
    # rewritten together with its manifest entry passes them; the tensor pass compares each tensor
    # with its layout-free digest, as restore does; the other items' digests are recomputed only by
    # --restore.
    all_tensors = bool(tensors) and all(t["not_checked"] is None for t in tensors.values())
    compared = [
        "files",
        *(["checksums"] if deep else []),
        *(["tensor digests"] if all_tensors else []),
        *(["restored digests"] if restored else []),
    ]
    _emit(
        findings,
        as_json,
        {
            "checked": [str(p) for p in steps],
            "cost": costs_json,
            "restored": restored,
            "compared": compared,
            "tensors": tensors,
        },
    )
    if not as_json:
        for key, c in costs.items():
            if c:
                click.echo(printable(f"cost    {Path(key).name}: {_cost_line(c)}"))
    if not as_json:
        verdict = "FAIL" if _verify.worst(findings) else "OK"
        # Exactly what was compared: without --deep, the files' presence and sizes and the DCP
        # metadata only.
        how = (
            " with checksums"
            if deep
            else (
                " (files, sizes and DCP metadata against the manifest; checksums and "
                "tensor digests not compared: add --deep)"
            )
        )
        if all_tensors:
            how += " and tensor digests"
        unchecked = {Path(k).name: t["not_checked"] for k, t in tensors.items() if t["not_checked"]}
        if unchecked:
            name, why = next(iter(unchecked.items()))
            how += (
                f" (tensor digests NOT compared for {len(unchecked)} step(s), e.g. {name}: {why})"
            )
        if restored:
            how += " and a real restore"
        elif do_restore:
            how += "; restore skipped: fix the ERROR findings first"
        elif deep:
            how += " (--restore also compares the non-tensor items a restore compares)"
        click.echo(f"{verdict}: {len(steps)} step(s) checked{how}, {len(findings)} finding(s)")
    sys.exit(_verify.worst(findings))


def _verify_remote(url: str, deep: bool, do_restore: bool, template: str, as_json: bool) -> None:
    from .ops import remote as _remote
    from .ops import verify as _verify

    if do_restore:
        raise ConfigError(
            "verify --restore reads a local root; for s3:// use --deep "
            "(every object downloaded and "
            'checked), or restore it with CheckpointManager("s3://...").restore'
        )
    checked, findings = _remote.verify_remote(url, template, deep=deep)
    _emit(findings, as_json, {"checked": checked, "restored": False})
    if not as_json:
        verdict = "FAIL" if _verify.worst(findings) else "OK"
        click.echo(
            f"{verdict}: {len(checked)} step(s) checked{' with checksums' if deep else ''}, "
            f"{len(findings)} finding(s)"
        )
    sys.exit(_verify.worst(findings))


def _is_export(path: Path) -> bool:
    from .ops import export as _export

    return _export.is_export(path)


def _verify_export(path: Path, deep: bool, as_json: bool) -> NoReturn:
    from .ops import export as _export
    from .ops import verify as _verify

    check = _export.check_export(path, deep=deep)
    findings = check.findings
    _emit(
        findings,
        as_json,
        {
            "checked": [str(path)],
            "export": True,
            "compared": check.compared,
            "not_compared": check.not_compared,
        },
    )
    if not as_json:  # exactly what was compared: never "tensor digests" when a finding skipped them
        how = ", ".join(check.compared) or "nothing (the export manifest is unreadable)"
        if check.not_compared:
            how += f"; tensor digests NOT compared: {check.not_compared}"
        click.echo(
            f"{'FAIL' if _verify.worst(findings) else 'OK'}: export checked ({how}), "
            f"{len(findings)} finding(s)"
        )
    sys.exit(_verify.worst(findings))


def _restore_with_progress(_verify: Any, steps: list[Path], as_json: bool) -> list[Any]:
    """The restore check, with a progress bar on stderr (bytes restored) on a terminal."""
    with _progress(_inspect.state_bytes(steps), "restore", as_json) as bar:

        def progress(step_dir: Path, event: dict[str, Any]) -> None:
            bar.label = f"restore {step_dir.name} rank {event['rank'] + 1}/{event['world']}"
            bar.update(int(event.get("bytes", 0)))

        found: list[Any] = _verify.restore_check(steps, progress=progress)
        return found


@main.command()
@click.argument("root", type=_Local(path_type=Path, exists=True, file_okay=False))
@click.argument("step", type=int, required=False)
@click.option(
    "--hf",
    "out",
    type=_Local(path_type=Path),
    required=True,
    help="New directory for the Hugging Face files (safetensors shards, index, config/tokenizer).",
)
@click.option(
    "--dtype",
    type=click.Choice(["fp32", "bf16", "fp16"]),
    help="Cast floating tensors (checked first).",
)
@click.option("--item", help="The model item to export when the step holds several.")
@click.option(
    "--merged", is_flag=True, help="A LoRA step: write its base model with the adapter merged once."
)
@click.option(
    "--max-host-bytes",
    type=int,
    default=2 << 30,
    show_default=True,
    help="Host bytes of tensors held at once (one output file, one tensor "
    "before its cast, the reader).",
)
@TEMPLATE
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def export(
    root: Path,
    step: int | None,
    out: Path,
    dtype: str | None,
    item: str | None,
    merged: bool,
    max_host_bytes: int,
    template: str,
    as_json: bool,
) -> None:
    """Export STEP (default: the tracker's) of ROOT (or the step directory ROOT) as Hugging Face
    safetensors.

    Every tensor is checked against the step's layout-free digest as it is read (before a cast) and
    again as written; OUT appears only once all of it is written and checked, its manifest last.
    """
    from .ops import export as _export
    from .ops import merge as _merge

    step_dir = _export.step_dir_of(root, step, template)
    show = not as_json and sys.stderr.isatty()
    cast = _export.DTYPES.get(dtype or "")
    total = (
        0
        if merged
        else sum(p.out_bytes for p in _export.plan_export(step_dir, item=item, dtype=cast))
    )
    with click.progressbar(
        length=max(total, 1), label="export", file=sys.stderr, hidden=not show
    ) as bar:
        done = [0]

        def progress(event: dict[str, Any]) -> None:
            bar.update(event["bytes"] - done[0])
            done[0] = event["bytes"]

        if merged:
            result = _merge.export_merged(step_dir, out, dtype=cast, max_host_bytes=max_host_bytes)
        else:
            result = _export.export_hf(
                step_dir,
                out,
                item=item,
                dtype=cast,
                max_host_bytes=max_host_bytes,
                progress=progress,
            )
    if as_json:
        _json_out(True, **result.to_json())
    else:
        click.echo(
            printable(
                f"exported step {result.step} ({result.item}): {result.tensors} tensors, "
                f"{_size(result.bytes)} in {len(result.files)} files to {result.out}"
                + (f", cast to {result.dtype}" if result.dtype else "")
                + (", the adapter merged into its base" if merged else "")
                + (f"; copied {', '.join(result.copied)}" if result.copied else "")
            )
        )


@main.command()
@click.argument("root", type=_RootOrURL(exists=False))
@click.option(
    "--hosts",
    type=_Local(path_type=Path, exists=True, dir_okay=False),
    help="New allocation: one host per line; ranks fill hosts in equal contiguous blocks.",
)
@click.option(
    "--rank-hosts",
    type=_Local(path_type=Path, exists=True, dir_okay=False),
    help="New allocation: 'RANK HOST' per line, or a JSON object {rank: host}.",
)
@click.option(
    "--expect-step", type=click.IntRange(0), help="Fail unless the resume step is this one."
)
@TEMPLATE
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def preflight(
    root: Path | str,
    hosts: Path | None,
    rank_hosts: Path | None,
    expect_step: int | None,
    template: str,
    as_json: bool,
) -> None:
    """Before a launch: the resume step and path, its completeness, and each rank's files on its
    host.

    ROOT may be s3://bucket/prefix: the tracker's step, each of its objects present with the size
    and ETag its marker recorded, and the store's write lease (a live job holding it is a WARNING).
    Exit 0 ready to launch, 1 not ready (a ROOT that does not exist here included), 2 bad usage.
    """
    from .ops import preflight as _pre

    if hosts and rank_hosts:
        raise click.UsageError("give --hosts or --rank-hosts, not both")
    if isinstance(root, str):
        if hosts or rank_hosts:
            raise click.UsageError(
                "--hosts/--rank-hosts check the files on each host's disk; on an s3:// root every "
                "rank downloads its files from the store: leave them out"
            )
        _preflight_remote(root, expect_step, template, as_json)
    naming = _inspect.naming(template)
    root = root.absolute()
    report = _pre.preflight(root, naming, expect_step=expect_step)
    if report.ok and report.path and (hosts or rank_hosts):
        world = _inspect.world_size(Path(report.path))
        try:
            if hosts:
                placement = _pre.parse_hosts(hosts, world)
            else:
                assert rank_hosts is not None  # one of the two, checked above
                placement = _pre.parse_rank_hosts(rank_hosts)
        except CheckpointError as exc:
            raise click.UsageError(str(exc)) from None
        report = _pre.preflight(root, naming, expect_step=expect_step, rank_hosts=placement)
    if not as_json:
        where = f"step {report.step} at {report.path or '(fresh start)'} ({report.reason})"
        click.echo(
            printable(f"resume: {where}") if report.step is not None else "resume: unresolved"
        )
    if not as_json and report.roles:
        click.echo(
            printable("roles: " + ", ".join(f"{n} (ranks {r})" for n, r in report.roles.items()))
        )
    _emit(
        report.findings,
        as_json,
        {"step": report.step, "path": report.path, "reason": report.reason, "roles": report.roles},
    )
    if not as_json:
        click.echo(
            "READY" if report.ok else "NOT READY: fix the ERROR lines above before launching"
        )
    sys.exit(0 if report.ok else 1)


def _preflight_remote(url: str, expect_step: int | None, template: str, as_json: bool) -> NoReturn:
    from .ops import remote as _remote

    report = _remote.preflight_remote(url, template, expect_step=expect_step)
    if not as_json:
        where = f"step {report.step} at {report.url or '(fresh start)'} ({report.reason})"
        click.echo(
            printable(f"resume: {where}") if report.step is not None else "resume: unresolved"
        )
    _emit(
        report.findings, as_json, {"step": report.step, "path": report.url, "reason": report.reason}
    )
    if not as_json:
        click.echo(
            "READY" if report.ok else "NOT READY: fix the ERROR lines above before launching"
        )
    sys.exit(0 if report.ok else 1)


@main.command()
@click.argument("root", type=_RootOrURL())
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@click.option(
    "--orphans",
    is_flag=True,
    help="Also remove step directories newer than the tracker, complete or not (needs a tracker).",
)
@click.option(
    "--force", is_flag=True, help="Run even though a live run holds the root's write lease."
)
@click.option(
    "--min-age",
    "min_age_s",
    type=click.FloatRange(0),
    default=3600.0,
    show_default=True,
    help="s3:// roots: remove only unmarked attempts whose newest object is older than this "
    "(seconds) and, written on this host, whose process is gone.",
)
@TEMPLATE
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON object: what was removed and what was kept.",
)
def gc(
    root: Path | str,
    dry_run: bool,
    orphans: bool,
    force: bool,
    min_age_s: float,
    template: str,
    as_json: bool,
) -> None:
    """Remove what crashes left under ROOT: dead saves' temp directories, interrupted deletes, temp
    files.

    ROOT may be s3://bucket/prefix: attempts no marker names that carry ckptguard's owner record and
    are older than --min-age (and, written on this host, whose process is gone) are removed (owner
    record last) and their multipart uploads aborted; anything else under the prefix is listed as
    foreign and left alone.

    Acts only on a checkpoint root (a tracker or contract/ present) and only on entries ckptguard
    created. A complete checkpoint is never removed, whatever the tracker says: a step newer than
    the tracker (or any step when the tracker is missing) is listed with what to do, and removed
    only with --orphans. Foreign entries and incomplete steps are listed and left alone; rotation
    handles committed steps. Refused while a live run holds the root's lease (its newest step may be
    a commit in flight) unless --force or --dry-run. Exit 0 done, 1 refused, 2 bad usage (not a
    root).
    """
    with _progress(1, "gc", as_json) as bar:

        def progress(phase: str, done: int, total: int) -> None:
            doing = "removing" if phase == "remove" else f"checking {phase}"
            bar.label = f"gc: {doing} {done}/{total}"
            bar.length = max(total, 1)
            bar.update(done - bar.pos)

        try:
            report = _collect(root, template, dry_run, orphans, force, min_age_s, progress)
        except ConfigError as exc:
            if as_json:
                _fail(str(exc), True, code=2)
            raise click.UsageError(str(exc)) from None
        except CheckpointError as exc:
            _fail(str(exc), as_json)
        except OSError as exc:
            # e.g. a directory it may not delete: what is done stays done, rerun after fixing
            _fail(f"gc of {root} stopped: {exc}; fix the cause and run it again", as_json)
    where = str(root.absolute()) if isinstance(root, Path) else root
    if as_json:
        _json_out(
            True,
            root=where,
            dry_run=dry_run,
            removed=[{"path": str(p), "what": what} for p, what in report.removed],
            kept=[{"path": str(p), "why": why} for p, why in report.kept],
        )
        return
    for path, what in report.removed:
        click.echo(printable(f"{'would remove' if dry_run else 'removed'} {path}: {what}"))
    for path, why in report.kept:
        click.echo(printable(f"kept    {path}: {why}"))
    n = len(report.removed)
    click.echo(
        f"{n} entr{'y' if n == 1 else 'ies'} {'to remove' if dry_run else 'removed'}, "
        f"{len(report.kept)} left in place{' (listed above)' if report.kept else ''}"
    )


def _collect(
    root: Path | str,
    template: str,
    dry_run: bool,
    orphans: bool,
    force: bool,
    min_age_s: float,
    progress: Callable[[str, int, int], None],
) -> GcReport:
    """gc of either root kind: one procedure (``ops.gc.collect``), the root kind's survey."""
    if isinstance(root, str):
        from .ops import remote as _remote

        return _remote.gc_remote(
            root,
            template,
            min_age_s=min_age_s,
            dry_run=dry_run,
            force=force,
            orphans=orphans,
            progress=progress,
        )
    from .ops import gc as _gc

    naming = _inspect.naming(template)
    return _gc.gc(
        root.absolute(), naming, dry_run=dry_run, orphans=orphans, force=force, progress=progress
    )


@main.command()
@click.argument("root", type=_Local(path_type=Path, exists=True, file_okay=False))
@click.argument("step", type=click.IntRange(1))
@TEMPLATE
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def adopt(root: Path, step: int, template: str, as_json: bool) -> None:
    """Point ROOT's tracker at STEP, a complete checkpoint newer than the tracker (an orphan).

    For a save that died between publishing and moving the tracker, or a root whose tracker was
    lost. STEP is verified with checksums and must belong to ROOT's run chain; the tracker only
    moves forward, under the root's lease. (To continue from another run's checkpoint, see
    CheckpointManager.adopt.) Exit 0 done, 1 refused, 2 bad usage (a bad --template).
    """
    from .ops import gc as _gc

    naming = _inspect.naming(
        template
    )  # a bad template is bad usage (exit 2), checked before the root is read
    try:
        was = _inspect.tracker(root)
        message = _gc.adopt_step(root.absolute(), naming, step)
    except CheckpointError as exc:
        _fail(str(exc), as_json)
    except OSError as exc:
        _fail(
            f"adopt of step {step} under {root} failed: {exc}; the tracker was not moved", as_json
        )
    if as_json:
        _json_out(
            True,
            root=str(root.absolute()),
            step=step,
            tracker_was=was,
            tracker=step,
            message=message,
        )
    else:
        click.echo(printable(message))


@main.command()
@click.argument("root", type=_Local(path_type=Path, exists=True, file_okay=False))
@click.argument("step", type=click.IntRange(1))
@click.option("--reason", required=True, help="Who needs this step and until when.")
@click.option(
    "--ttl",
    "ttl_s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Seconds: a reader lease that expires unless renewed (run the same command again to "
    "renew it), for a script that reads the step; without it the hold lasts until released.",
)
@TEMPLATE
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def hold(
    root: Path, step: int, reason: str, ttl_s: float | None, template: str, as_json: bool
) -> None:
    """Pin STEP under ROOT against rotation and gc (e.g. for evaluation); survives restarts. In
    Python, `with ckptguard.open_step(root, step):` holds a step while a block reads it."""
    try:
        where = _inspect.hold(root, template, step, reason, ttl_s)
    except CheckpointError as exc:
        _fail(str(exc), as_json)
    if as_json:
        _json_out(
            True, root=str(root.absolute()), step=step, reason=reason, hold=str(where), ttl_s=ttl_s
        )
    else:
        until = f" for {ttl_s:g} s (renew by running this again)" if ttl_s is not None else ""
        click.echo(printable(f"held step {step}{until}: {where}"))


@main.command()
@click.argument("root", type=_Local(path_type=Path, exists=True, file_okay=False))
@click.argument("step", type=click.IntRange(1))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def release(root: Path, step: int, as_json: bool) -> None:
    """Remove the hold on STEP; rotation may then delete it."""
    try:
        released = _inspect.release(root, step)
    except OSError as exc:
        _fail(f"could not remove the hold of step {step} under {root}: {exc}", as_json)
    if not released:
        _fail(
            f"step {step} has no hold under {root}: nothing was released (`ckptguard list {root}` "
            f"shows the steps; holds live in ROOT/holds/)",
            as_json,
        )
    if as_json:
        _json_out(True, root=str(root.absolute()), step=step, released=True)
    else:
        click.echo(f"released step {step}")


def _gate_table(gates: list[Any]) -> None:
    width = max(len(g.name) for g in gates)
    click.echo(f"{'gate':<{width}}  {'result':<7}  evidence")
    for g in gates:
        click.echo(f"{g.name:<{width}}  {g.status.value:<7}  {g.evidence}")


@main.command()
@click.argument("root", type=_RootOrURL())
@click.option(
    "--json", "as_json", is_flag=True, help="Print the verdict and the gates as one JSON object."
)
@click.option(
    "--resume",
    "resume",
    type=click.IntRange(1),
    default=None,
    metavar="N",
    help="Judge resume N (1 is the oldest restore of a non-zero step) instead of "
    "the newest with evidence.",
)
@click.option(
    "--all", "every", is_flag=True, help="Judge each resume in turn: a verdict line per resume."
)
def prove(root: Path | str, as_json: bool, resume: int | None, every: bool) -> None:
    """Evaluate the resume-proof gates from ROOT/proof records, with evidence, and a one-line
    verdict.

    ROOT may be s3://bucket/prefix: the records are the copies every rank puts in its proof/ at each
    save and at close (a lost node's records included); a staging root holds the live ones.

    Each gate is PASS, FAIL (a difference found), MISSING (nothing to compare: an event never
    recorded, or a kill that landed before the reference was recorded), INFO or N/A (the job's
    ProofPlan, recorded with the save, says it does not apply). The judged resume is the newest
    that recorded a step after its restore (the `resume judged` line says which); --resume N
    judges another, --all each (the exit code is the worst of theirs). docs/proof.md explains
    each verdict.

    \b
    Exit codes:
      0  resume PROVEN: every required gate passed
      1  resume NOT proven: a gate FAILed (the resumed run differs from the killed run), or the
         proof records could not be read
      2  bad usage
      3  resume EVIDENCE MISSING: no gate FAILed, but a required gate had nothing to compare
         (the verdict line names each, with the rank, the step and what was not recorded)
    """
    if every and resume is not None:
        raise click.UsageError("--all judges every resume: give it or --resume N, not both")
    if isinstance(root, str):
        from .ops import remote as _remote

        with tempfile.TemporaryDirectory(prefix="ckptguard-prove-") as tmp:
            _remote.fetch_proof(root, "step_{step:08d}", Path(tmp))
            _prove(Path(tmp), as_json, resume, every)
    _prove(Path(root), as_json, resume, every)


def _refuse_step_for_root(path: Path, command: str, as_json: bool) -> None:
    """``path`` is a step directory where ``command`` takes the root."""
    if _inspect.level(path) == "step":
        _fail(
            f"{path} is a step directory (it holds manifest.json); {command} takes the checkpoint "
            f"root that holds it and its proof/ records: `ckptguard {command} "
            f"{path.absolute().parent}`",
            as_json,
            code=2,
        )


def _refuse_root_for_step(path: Path, command: str, as_json: bool) -> None:
    """``path`` is a checkpoint root where ``command`` takes a committed step."""
    if _inspect.level(path) == "root":
        try:
            newest = _inspect.tracker(path)
        except (CheckpointError, OSError):
            newest = None
        name = _inspect.naming("step_{step:08d}").name(newest) if newest else "step_<N>"
        _fail(
            f"{path} is a checkpoint root (it holds the tracker, which says {newest}); {command} "
            f"takes one committed step directory under it, e.g. {path / name}",
            as_json,
            code=2,
        )


def _prove(root: Path, as_json: bool, resume: int | None, every: bool) -> NoReturn:
    from .ops.prove import EXIT_CODES, evaluate, outcome, resume_count, to_json, verdict

    _refuse_step_for_root(root, "prove", as_json)

    if every:
        _prove_all(root.absolute(), as_json)
    try:
        found = resume_count(root.absolute()) if resume is not None else []
        if resume is not None and resume > len(
            found
        ):  # a number the records do not hold is bad usage
            shown = ", ".join(f"{r.number}: step {r.step}" for r in found)
            _fail(
                f"--resume {resume}: the records under {root}/proof hold resumes "
                f"1-{len(found)} ({shown})",
                as_json,
                code=2,
            )
        gates = evaluate(root.absolute(), resume=resume)
    except CheckpointError as exc:
        _fail(str(exc), as_json)
    if as_json:
        proof = to_json(gates)
        _json_out(
            proof["proven"], **({} if proof["proven"] else {"error": proof["verdict"]}), **proof
        )
    else:
        _gate_table(gates)
        click.echo(f"\n{verdict(gates)}")
    sys.exit(EXIT_CODES[outcome(gates)])


def _prove_all(root: Path, as_json: bool) -> None:
    """`prove --all`: every resume judged, one line each (and the first failing gate's evidence)."""
    from .ops.prove import EXIT_CODES, evaluate, outcome, resume_count, to_json, verdict, worst

    try:
        found = resume_count(root)
        judged = [(r, evaluate(root, resume=r.number)) for r in found]
    except CheckpointError as exc:
        _fail(str(exc), as_json)
    if not found:
        _fail(
            f"{root}: the proof records hold no restore of a non-zero step: nothing to judge",
            as_json,
        )
    if as_json:
        rows = [{"resume": r.number, "step": r.step, "pid": r.pid, **to_json(g)} for r, g in judged]
        result = worst([outcome(g) for _r, g in judged])
        proven = all(r["proven"] for r in rows)
        failed = [r["resume"] for r in rows if not r["proven"]]
        _json_out(
            proven,
            **({} if proven else {"error": f"resumes {failed} are not proven ({result.value})"}),
            proven=proven,
            outcome=result.value,
            exit_code=EXIT_CODES[result],
            resumes=rows,
        )
    else:
        for r, gates in judged:
            click.echo(f"resume {r.number} (step {r.step}, pid {r.pid}): {verdict(gates)}")
            bad = next((g for g in gates if g.status.value == "FAIL"), None) or next(
                (g for g in gates if g.required and g.status.value != "PASS"), None
            )
            if bad is not None and bad.status.value == "FAIL":
                click.echo(f"    {bad.name}: {bad.evidence}")
    sys.exit(EXIT_CODES[worst([outcome(g) for _r, g in judged])])


@main.command()
@click.option(
    "--workdir",
    default="demo-run",
    show_default=True,
    type=_Local(path_type=Path),
    help="Working directory: new or empty, or one an earlier demo created (wiped "
    "first); any other is refused.",
)
@click.option(
    "--world-size",
    type=click.IntRange(1, 4),
    default=2,
    show_default=True,
    help="CPU ranks (gloo; FSDP2 above 1).",
)
@click.option("--steps", type=click.IntRange(4, 1000), default=12, show_default=True)
@click.option("--save-every", type=click.IntRange(1), default=3, show_default=True)
@click.option(
    "--kill-at",
    type=click.IntRange(2),
    default=9,
    show_default=True,
    help="The step whose save is SIGKILLed mid-write (a multiple of --save-every).",
)
@click.option(
    "--no-derived-fix",
    is_flag=True,
    help="Negative control: the restore does not invalidate the FP8 scale "
    "cache; the proof must FAIL.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the verdict and the gates as one JSON object (the narration goes to stderr).",
)
def demo(
    workdir: Path,
    world_size: int,
    steps: int,
    save_every: int,
    kill_at: int,
    no_derived_fix: bool,
    as_json: bool,
) -> None:
    """A tiny RL job on the CPU: SIGKILL mid-save, resume with AUTO, and the proof table.

    WORKDIR is wiped first, so it must be new, empty, or made by an earlier demo (it holds a
    .ckptguard-demo marker); a non-empty directory the demo did not create is refused (exit 2).
    """
    from .demo.job import prepare_workdir, run_demo
    from .ops.prove import passed, to_json, verdict

    def usage(message: str) -> NoReturn:
        if as_json:
            _fail(message, True, code=2)
        raise click.UsageError(message)

    if kill_at % save_every or not save_every < kill_at < steps:
        usage("need --save-every < --kill-at < --steps with --kill-at a multiple of --save-every")
    try:
        prepare_workdir(workdir)
    except ConfigError as exc:
        usage(str(exc))
    gates, root = run_demo(
        str(workdir),
        world=world_size,
        steps=steps,
        save_every=save_every,
        kill_at=kill_at,
        derived_fix=not no_derived_fix,
        echo=(lambda line: click.echo(line, err=True)) if as_json else click.echo,
    )
    ok = passed(gates)
    if as_json:
        failed = {} if ok else {"error": f"{verdict(gates)} (records in {root}/proof)"}
        _json_out(ok, **failed, root=str(root), **to_json(gates))
        sys.exit(0 if ok else 1)
    click.echo("")
    _gate_table(gates)
    click.echo(f"\n{verdict(gates)}" + ("" if ok else f" (records in {root}/proof)"))
    sys.exit(0 if ok else 1)


@main.command(name="repro-save")
@click.option(
    "--target",
    required=True,
    type=_Local(path_type=Path, file_okay=False),
    help="Directory on the filesystem under suspicion.",
)
@click.option(
    "--control",
    type=_Local(path_type=Path, file_okay=False),
    help="Same run on a control path (e.g. node-local disk), printed side by side.",
)
@click.option("--rounds", type=click.IntRange(1, 10000), default=10, show_default=True)
@click.option(
    "--size",
    "size_gib",
    type=click.FloatRange(0.0001, 4096),
    default=1.0,
    show_default=True,
    help="GiB of tensor state per save, split across ranks.",
)
@click.option("--ranks", type=click.IntRange(1, 64), default=1, show_default=True)
@click.option(
    "--report", type=_Local(path_type=Path, dir_okay=False), help="Also write the JSON report here."
)
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report.")
def repro_save(
    target: Path,
    control: Path | None,
    rounds: int,
    size_gib: float,
    ranks: int,
    report: Path | None,
    as_json: bool,
) -> None:
    """Repeat ckptguard's real save on TARGET until the first failure, and keep the scene.

    Exit 0 if every round committed (on every path), 1 if a round failed.
    """
    from .ops.repro import ReproConfig, run_repro

    cfg = ReproConfig(rounds=rounds, size_gib=size_gib, ranks=ranks)
    paths = {"target": target, **({"control": control} if control else {})}
    for (
        label,
        path,
    ) in paths.items():  # before any round: a typo must not cost the other path's rounds first
        if not path.absolute().parent.is_dir():
            _fail(
                f"--{label} {path}: its parent {path.absolute().parent} is not a "
                f"directory; name a directory on the filesystem under test (it is made if "
                f"only its last part is missing)",
                as_json,
                code=2,
            )
    reports = {}
    for label, path in paths.items():
        if not as_json:
            click.echo(
                f"{label}: {rounds} round(s) of {size_gib:g} GiB on {ranks} "
                f"rank(s) under {path} ...",
                err=True,
            )
        with _progress(rounds, f"{label}: rounds", as_json) as bar:

            def committed(n: int, bar: Any = bar) -> None:
                bar.update(n - bar.pos)

            reports[label] = run_repro(path, cfg, progress=committed)
    if report:
        report.write_text(json.dumps(reports, indent=1) + "\n")
    if as_json:
        click.echo(json.dumps(reports, indent=1))
    else:
        _repro_table(reports)
    sys.exit(1 if any(r["failed"] for r in reports.values()) else 0)


def _repro_table(reports: dict[str, Any]) -> None:
    def row(name: str, fn: Any) -> None:
        click.echo(f"{name:<24}" + "".join(f"{str(fn(r))[:60]:<62}" for r in reports.values()))

    row("", lambda r: "")
    click.echo(f"{'':<24}" + "".join(f"{label:<62}" for label in reports))
    row("path", lambda r: r["target"])
    row("filesystem", lambda r: f"{r['filesystem']['type']} on {r['filesystem']['mount']}")
    row(
        "free before / after",
        lambda r: f"{r['filesystem']['free_bytes'] >> 20} / {r['free_bytes_after'] >> 20} MiB",
    )
    row("free inodes", lambda r: r["filesystem"]["free_inodes"])
    row("rounds committed", lambda r: f"{r['completed_rounds']} of {r['config']['rounds']}")
    row(
        "GiB/s (median)", lambda r: f"{r['gib_per_s_median']:.2f}" if r["gib_per_s_median"] else "-"
    )
    row("threads first->last", lambda r: r["growth_first_to_last_round"].get("threads", "-"))
    row("open files first->last", lambda r: r["growth_first_to_last_round"].get("fds", "-"))
    row("oom_kill before/after", lambda r: f"{r['oom_kill_before']} / {r['oom_kill_after']}")
    row("first failure", lambda r: _describe_failure(r["first_failure"]))
    row("scene kept", lambda r: ", ".join(r["kept_scene"]) or "-")


def _describe_failure(f: dict[str, Any] | None) -> str:
    if not f:
        return "none"
    first = f.get("first")
    if first:
        return f"round {f['round']}: rank {first['rank']} errno {first['errno']} {first['path']}"
    return f"round {f['round']}: {f['type']}"


@main.command()
@click.argument("step_dir", type=_RootOrURL())
@click.argument("dest_root", type=_RootOrURL(exists=False))
@click.option(
    "--record",
    type=_Local(path_type=Path, dir_okay=False),
    help="Where to write the transfer record (default DEST_ROOT/transfers/).",
)
@click.option(
    "--step",
    type=click.IntRange(1),
    default=None,
    help="With an s3:// source: the committed step to copy (default: the tracker's).",
)
@TEMPLATE
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON object: the transfer record, or the error.",
)
def transfer(
    step_dir: Path | str,
    dest_root: Path | str,
    record: Path | None,
    step: int | None,
    template: str,
    as_json: bool,
) -> None:
    """Copy a committed STEP_DIR to DEST_ROOT (e.g. a new node) with the save's publish protocol.

    Each file is copied to a temp name, fsynced, checked against the manifest and renamed; the
    destination's tracker moves only after everything verified. The destination's write lease is
    held meanwhile, so a live run there refuses it. A transfer killed before it set the tracker is
    finished by running it again. Exit 0 done, 1 refused or failed.

    Object stores: `transfer STEP_DIR s3://bucket/prefix` commits the step on the store (uploaded
    under its own attempt, the marker created last, the tracker moved by If-Match; a step at or
    below the store's tracker is refused), `transfer s3://bucket/prefix DEST_ROOT [--step N]`
    copies the store's committed step into a local root (downloaded and checked into a temp
    directory, renamed, then the tracker). A killed transfer leaves nothing visible; `gc` removes
    what it left.
    """
    if isinstance(step_dir, str) or isinstance(dest_root, str):
        return _transfer_remote(step_dir, dest_root, record, step, template, as_json)
    if step is not None:
        raise click.UsageError(
            "--step picks a step of an s3:// source; a local source is its STEP_DIR"
        )
    _refuse_root_for_step(step_dir, "transfer", as_json)
    from .ops.transfer import describe
    from .ops.transfer import transfer as _transfer

    try:
        with _progress(1, f"transfer {step_dir.name}", as_json) as bar:

            def progress(done: int, total: int) -> None:
                bar.length = max(total, 1)
                bar.update(done - bar.pos)

            info = _transfer(step_dir, dest_root, record=record, progress=progress)
    except CheckpointError as exc:
        _fail(str(exc), as_json)
    except OSError as exc:  # ENOSPC, EACCES...: the tracker moves last, so it was not moved
        _fail(
            f"transfer of {step_dir} to {dest_root} failed: {_os_message(exc)}; the destination's "
            f"tracker moves only once every file is verified. Fix the cause and run the same "
            f"transfer again (it finishes a complete copy)",
            as_json,
        )
    if as_json:
        _json_out(
            True,
            **{k: v for k, v in info.items() if k != "files"},
            files=len(info["files"]),
            bytes=sum(int(f["size"]) for f in info["files"]),
        )
    else:
        click.echo("\n".join(printable(line) for line in describe(info).splitlines()))


def _transfer_remote(
    source: Path | str,
    dest: Path | str,
    record: Path | None,
    step: int | None,
    template: str,
    as_json: bool,
) -> None:
    from .ops import storetransfer as _st

    if isinstance(source, str) and isinstance(dest, str):
        raise click.UsageError(
            "both are s3:// roots: transfer through a local root (s3 -> local, then local -> s3)"
        )
    if record is not None and isinstance(dest, str):
        raise click.UsageError(
            "--record is where a local destination's transfer record goes; on the store the "
            "marker names the transfer as its writer (--json prints the rest)"
        )
    with _progress(1, "transfer", as_json) as bar:

        def progress(done: int, total: int) -> None:
            bar.length = max(total, 1)
            bar.update(done - bar.pos)

        if isinstance(dest, str):
            if step is not None:
                raise click.UsageError(
                    "--step picks a step of an s3:// source; a local source is its STEP_DIR"
                )
            info = _st.to_store(Path(source), dest, template=template, progress=progress)
        else:
            info = _st.from_store(
                str(source), dest, step=step, template=template, record=record, progress=progress
            )
    if as_json:
        _json_out(True, **info)
        return
    click.echo(printable(f"step {info['step']}: {info['source']} -> {info['destination']}"))
    click.echo(
        f"  {info['files']} file(s), {info['bytes']} bytes, each checked; "
        f"{'resumed an interrupted transfer; ' if info.get('resumed') else ''}"
        f"tracker of the destination: step {info['tracker_set_to']}, "
        f"in {info['finished_unix'] - info['started_unix']:.2f} s"
    )
    if info.get("record"):
        click.echo(printable(f"  record: {info['record']}"))


@main.command()
@click.argument("path", type=_Local(path_type=Path, exists=True))
@click.option(
    "--sample",
    "sample_s",
    type=click.FloatRange(0.05, 10),
    default=0.5,
    show_default=True,
    help="Seconds between the two /proc readings of each local process.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per rank.")
def status(path: Path, sample_s: float, as_json: bool) -> None:
    """Each rank's current phase, for how long, against its typical duration, and whether it is
    busy.

    PATH is a phase-records file (PhaseRecorder) or a directory holding them. Tells a stalled
    rank (no CPU, no I/O, overdue) from a slow one: slow is not a hang. On a RunCheckpoint root
    each rank's line names the roles it holds. On a checkpoint root it first says the root's state
    (newest committed step, what a resume would do now, steps a resume skips) and which saves a
    commit in flight held back (skipped, coalesced, redirected) since the last save. Exit 0 if no
    rank is stalled, 1 if one is stalled or died inside a phase (for a watchdog); without phase
    records: 0 on a checkpoint root a resume would accept, 1 otherwise (nothing checked).
    """
    from dataclasses import asdict

    from .ops.status import busy_saves, record_files, root_state, run_rank_roles
    from .ops.status import status as _status

    state = root_state(path) if path.is_dir() else None
    roles = run_rank_roles(path)
    if state is not None and roles:
        names = sorted({r for rs in roles.values() for r in rs})
        state.lines.insert(
            1, f"a RunCheckpoint root of roles {names} (ranks: {_roles_by_rank(roles)})"
        )
    if state is not None and not as_json:
        for line in state.lines:
            click.echo(printable(line))
    files = record_files(path)
    said: str | None = None
    try:
        busy = busy_saves(path) if path.is_dir() else None
        said = busy.line() if busy is not None else None
    except (
        CheckpointError,
        OSError,
    ) as exc:  # unreadable proof records do not hide the ranks' phases
        said = f"saves held back by a commit in flight: not checked ({exc})"
    if said is not None and not as_json:
        click.echo(printable(said))
    if (
        not files and state is not None
    ):  # a checkpoint root: its state is the answer, no rank was checked
        if as_json:
            _json_out(state.resumable, root=state.lines, ranks=[])
        else:
            click.echo(
                "no phase records here: no rank's phase was checked "
                "(ckptguard.memory.PhaseRecorder writes them)"
            )
        sys.exit(0 if state.resumable else 1)
    if not files:
        what = (
            f" (a RunCheckpoint root of roles {sorted({r for rs in roles.values() for r in rs})})"
            if roles
            else ""
        )
        where = (
            f"in {path}, which is no phase-records file"
            if path.is_file()
            else f"under {path}{what}"
        )
        _fail(
            f"no phase records {where}: no rank's status was checked; write them with "
            "ckptguard.memory.PhaseRecorder",
            as_json,
        )
    ranks = _status(files, sample_s=sample_s, roles=roles)
    if (
        as_json
    ):  # a list of ranks, as before; the held-back saves are in ``ckptguard goodput --json``
        click.echo(json.dumps([asdict(r) for r in ranks]))
    else:
        for r in ranks:
            held = f" ({', '.join(r.roles) or 'no role'})" if r.roles is not None else ""
            click.echo(
                printable(
                    f"rank {r.rank:<3}{held} pid {r.pid:<8} {r.node:<12} step {r.step}: {r.verdict}"
                )
            )
            if r.host_cache is not None:
                click.echo(printable(f"         {r.host_cache}"))
    sys.exit(1 if any(r.needs_attention for r in ranks) else 0)


def _roles_by_rank(roles: dict[int, list[str]]) -> str:
    return "; ".join(
        f"{rank}: {', '.join(names) or 'no role'}" for rank, names in sorted(roles.items())
    )


@main.command(context_settings={"ignore_unknown_options": True})
@click.option(
    "--root",
    required=True,
    type=_Local(path_type=Path, file_okay=False),
    help="The checkpoint root the training command writes.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(1),
    default=600,
    show_default=True,
    help="Longest wait for each point the rehearsal waits for (a save, a replayed step, a pause).",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the kills, both resumes' gates and the verdict as JSON.",
)
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
def rehearse(root: Path, timeout_s: float, as_json: bool, cmd: tuple[str, ...]) -> None:
    """Run CMD past a save and kill it, resume it and kill it mid-save, resume and save again; prove
    both resumes.

    CMD must be the long run's command (same save path, same layout) and call
    CheckpointManager.record_step every step. Every kill takes the whole process tree, torchrun's
    workers in their own sessions included. Use before a long run on a new save path or layout:

        ckptguard rehearse --root /ckpt/run1 -- torchrun --nproc_per_node 8 train.py ...

    \b
    Exit codes (as `ckptguard prove`'s):
      0  rehearsal PASSED: both resumes proven
      1  rehearsal FAILED: a gate FAILed on a resume, or the rehearsal could not run (the command
         exited early, a wait timed out, a process survived its kill)
      2  bad usage
      3  rehearsal INCONCLUSIVE: no gate FAILed, but a resume's evidence is missing (named)
    """
    from .ops.prove import EXIT_CODES, verdict
    from .ops.rehearse import rehearse as _rehearse

    try:
        result = _rehearse(
            list(cmd), root, timeout_s=timeout_s, echo=(lambda s: None) if as_json else click.echo
        )
    except CheckpointError as exc:
        _fail(str(exc), as_json)
    if as_json:
        _json_out(
            result.proven,
            **({} if result.proven else {"error": result.verdict()}),
            **result.to_json(),
        )
        sys.exit(EXIT_CODES[result.outcome])
    _gate_table(result.gates)
    click.echo("")
    for r in result.resumes:
        click.echo(f"resume after {r.after}: {verdict(r.gates).removeprefix('resume ')}")
    if result.cost:
        click.echo(f"\ncheckpoint of step {result.step}: {_cost_line(result.cost)}")
    click.echo(f"log: {result.log}")
    click.echo(f"\n{result.verdict()}")
    sys.exit(EXIT_CODES[result.outcome])


def _busy_more(g: Any) -> str:
    """The saves a busy policy other than SKIP kept out of a commit, when there were any."""
    more = [
        f"{n} {what}"
        for n, what in (
            (g.coalesced_saves, "coalesced (replaced in the queue)"),
            (g.redirected_saves, "to the fast tier only"),
        )
        if n
    ]
    return f" ({', '.join(more)})" if more else ""


@main.command()
@click.argument("root", type=_Local(path_type=Path, exists=True, file_okay=False))
@click.option(
    "--mtbf",
    "mtbf_s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Declared mean time between failures in seconds (default: observed from the relaunches).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as one JSON object.")
def goodput(root: Path, mtbf_s: float | None, as_json: bool) -> None:
    """What checkpointing and failures cost the run under ROOT, from its proof records.

    Per launch: the time to recover (process start to the first step after the restore: start-up,
    restore, first step), the steps lost to the failure before it, the seconds saves held the loop
    and the saves skipped while a commit ran. In total: the ETTR (effective training time ratio) and
    the Young/Daly save interval sqrt(2 x save cost x MTBF), printed with the inputs it used. Exit 1
    if ROOT has no proof records (nothing measured).
    """
    from dataclasses import asdict

    from .ops.goodput import goodput as _goodput

    try:
        g = _goodput(root.absolute(), mtbf_s=mtbf_s)
    except CheckpointError as exc:
        _fail(str(exc), as_json)
    if not g.launches:
        _fail(
            f"no proof records under {root}/proof: nothing was measured "
            f"(CheckpointConfig(proof=ProofPlan(record=True)) "
            "writes them)",
            as_json,
        )
    if as_json:
        _json_out(True, **{**g.to_json(), "launches": [asdict(x) for x in g.launches]})
        return

    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    click.echo(
        f"{'launch':<7} {'pid':>8} {'restored':>8} {'lost':>5} {'recover_s':>9} {'startup':>8} "
        f"{'restore':>8} {'1st step':>8} {'steps':>6} {'blocked_s':>9} {'skipped':>7}"
    )
    for i, x in enumerate(g.launches):
        click.echo(
            f"{i:<7} {x.pid:>8} {x.restored_step if x.restored_step is not None else '-':>8} "
            f"{x.lost_steps if x.lost_steps is not None else '-':>5} {s(x.recover_s):>9} "
            f"{s(x.startup_s):>8} {s(x.restore_s):>8} {s(x.to_first_step_s):>8} {x.steps:>6} "
            f"{x.blocked_s:>9.3f} {x.skipped_saves:>7}"
        )
    ettr = "-" if g.ettr is None else f"{100 * g.ettr:.1f}%"
    click.echo(
        f"\ntotal: {g.wall_s:.1f} s wall, {g.failures} failure(s), {g.recover_s:.2f} s "
        f"recovering, {g.lost_steps} step(s) lost ({g.lost_s:.2f} s), {g.blocked_s:.3f} s "
        f"blocked by saves, {g.skipped_saves} save(s) skipped{_busy_more(g)}, "
        f"{g.cleanup_s:.3f} s of retention off the loop; ETTR {ettr}"
    )
    if g.interval_s is None:
        click.echo(
            f"Young/Daly interval: not computed (save cost {s(g.save_cost_s)} s, MTBF "
            f"{s(g.mtbf_s)} s: needs a recorded save and a failure, or --mtbf)"
        )
    else:
        steps = f" = {g.interval_steps} steps of {g.step_s:.3f} s" if g.interval_steps else ""
        click.echo(
            f"Young/Daly interval: {g.interval_s:.1f} s{steps} (sqrt(2 x "
            f"{g.save_cost_s:.4f} s per save x MTBF {g.mtbf_s:.1f} s, {g.mtbf_source}); "
            f"never below one commit ({s(g.commit_s)} s)"
        )


def _fail(message: str, as_json: bool, code: int = 1) -> NoReturn:
    if as_json:
        _json_out(False, error=message)
    else:
        click.echo(f"error: {printable(message)}", err=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
