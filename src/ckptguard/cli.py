"""The ckptguard command line: a thin layer over the public API.

Exit codes: 0 success, 1 the check failed (or the checkpoint refused), 2 bad usage.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from . import __version__
from ._layout import StepNaming, read_tracker
from ._restore import resolve_local
from .config import ResumeMode
from .errors import CheckpointError

TEMPLATE = click.option(
    "--template",
    default="step_{step:08d}",
    show_default=True,
    help="Step directory name template (verl: 'global_step_{step}').",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckptguard")
def main() -> None:
    """Checkpoints that commit atomically across ranks, and resumes that are proven.

    Run `ckptguard demo` to watch a training job get killed, resume and be proven exact.
    """


@main.command()
@click.argument("root", type=click.Path(path_type=Path))
@click.option(
    "--mode",
    type=click.Choice([m.value for m in ResumeMode]),
    default="auto",
    show_default=True,
    help="auto: the tracker's step; must: fail instead of starting fresh; never: start fresh.",
)
@click.option("--path", "path", type=click.Path(path_type=Path), help="Resolve this step directory instead.")
@TEMPLATE
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def resolve(root: Path, mode: str, path: Path | None, template: str, as_json: bool) -> None:
    """Say which step a restore under ROOT would load, and why, without loading it.

    Exit 0 with the decision; exit 1 if a restore would refuse (and why).
    """
    try:
        res = resolve_local(root.absolute(), StepNaming(template), ResumeMode(mode), path)
    except CheckpointError as exc:
        _fail(str(exc), as_json)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "step": res.step,
                    "path": str(res.path) if res.path else None,
                    "fresh": res.fresh,
                    "reason": res.reason,
                }
            )
        )
    else:
        click.echo(res.describe())


@main.command(name="list")
@click.argument("root", type=click.Path(path_type=Path, exists=True, file_okay=False))
@TEMPLATE
def list_steps(root: Path, template: str) -> None:
    """List the step directories under ROOT and whether each is committed."""
    from . import _layout, _manifest

    naming = StepNaming(template)
    tracker = read_tracker(root)
    click.echo(f"tracker: {tracker if tracker is not None else 'absent'}")
    for step, path in sorted(_layout.step_dirs(root, naming).items()):
        try:
            _manifest.read(path)
            state = "committed" if tracker is not None and step <= tracker else "orphan (newer than tracker)"
        except CheckpointError as exc:
            state = f"NOT committed: {str(exc).split(':')[0]}"
        click.echo(f"{step:>10}  {state}  {path.name}")
    for tmp in sorted(root.glob(".tmp-*")):
        click.echo(f"{'-':>10}  in flight or abandoned  {tmp.name}")


@main.command()
@click.option(
    "--dir",
    "directory",
    default="demo-run",
    show_default=True,
    type=click.Path(path_type=Path),
    help="Working directory (wiped first).",
)
@click.option(
    "--ranks", type=click.IntRange(1, 4), default=2, show_default=True, help="CPU ranks (gloo; FSDP2 above 1)."
)
@click.option("--steps", type=click.IntRange(4, 1000), default=12, show_default=True)
@click.option("--save-every", type=click.IntRange(1), default=3, show_default=True)
@click.option(
    "--kill-at", type=click.IntRange(2), default=8, show_default=True, help="Step at which the job is SIGKILLed."
)
def demo(directory: Path, ranks: int, steps: int, save_every: int, kill_at: int) -> None:
    """Train a small job, SIGKILL it, resume it in a new process, and prove the resume exact."""
    from .demo import run_demo

    if not save_every < kill_at <= steps:
        raise click.UsageError("need --save-every < --kill-at <= --steps, so a step is saved before the kill")
    gates = run_demo(str(directory), ranks=ranks, steps=steps, save_every=save_every, kill_at=kill_at, echo=click.echo)
    width = max(len(g.name) for g in gates)
    click.echo("")
    click.echo(f"{'gate':<{width}}  result  evidence")
    for g in gates:
        click.echo(f"{g.name:<{width}}  {'PASS' if g.passed else 'FAIL':<6}  {g.evidence}")
    ok = all(g.passed for g in gates)
    click.echo("\nresume proven exact" if ok else "\nRESUME NOT PROVEN: see the FAIL rows above")
    sys.exit(0 if ok else 1)


def _fail(message: str, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps({"error": message}))
    else:
        click.echo(f"error: {message}", err=True)
    sys.exit(1)


if __name__ == "__main__":
    main()
