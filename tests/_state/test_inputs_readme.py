"""The README's Usage block runs exact as written: a DataLoader over a ``DataCursor`` sampler with
its own generator, a model with a Dropout, SIGKILLed mid-epoch and resumed, ends bitwise equal to
the uninterrupted run. Without the loader's own generator it does not (``iter(DataLoader)`` draws
its base seed from torch's global RNG, after ``restore()`` put it back in a resumed run): the
negative control."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "tests" / "readme_usage_job.py"

pytestmark = pytest.mark.timeout(600)


def _code_tree(tmp: Path) -> Path:
    """A git work tree with a commit (the block hashes the code with hash_git_tree('.'))."""
    code = tmp / "code"
    code.mkdir()
    (code / "train.py").write_text("# the training script\n")
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    for args in (["init", "-q"], ["add", "train.py"], ["commit", "-q", "-m", "code"]):
        subprocess.run(["git", "-C", str(code), *args], check=True, env=env, capture_output=True)
    return code


def _launch(tmp: Path, root: Path, kill_at: int, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(JOB), str(root), str(kill_at), *flags],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp / "code",
        timeout=300,
    )


def _result(proc: subprocess.CompletedProcess) -> dict:
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(line[len("RESULT ") :])


def _killed_and_resumed(tmp: Path, name: str, *flags: str) -> tuple[dict, dict]:
    """The uninterrupted run, and a run SIGKILLed at step 73 (saved at 50, mid-epoch) then
    relaunched."""
    ref = _result(_launch(tmp, tmp / f"{name}-ref", 0, *flags))
    (tmp / f"{name}-killed").mkdir()
    first = _launch(tmp, tmp / f"{name}-killed", 73, *flags)
    assert first.returncode == -9, first.stderr[-3000:]
    return ref, _result(_launch(tmp, tmp / f"{name}-killed", 0, *flags))


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("readme")
    _code_tree(tmp)
    return tmp


def test_the_readme_usage_block_killed_mid_epoch_resumes_bitwise(tmp):
    (tmp / "exact-ref").mkdir()
    ref, resumed = _killed_and_resumed(tmp, "exact")
    assert (
        ref["start"] == 0 and resumed["start"] == 50
    )  # resumed from the save at step 50 (mid-epoch 8)
    assert resumed["step"] == ref["step"] == 120 and resumed["tokens"] == ref["tokens"] == 120 * 8
    assert resumed["params"] == ref["params"] and resumed["optim"] == ref["optim"]


def test_without_the_loader_s_own_generator_the_dropout_masks_shift_after_the_resume(tmp):
    (tmp / "control-ref").mkdir()
    ref, resumed = _killed_and_resumed(tmp, "control", "--no-generator")
    assert (
        resumed["start"] == 50 and resumed["tokens"] == ref["tokens"]
    )  # the same data, every sample once
    assert resumed["params"] != ref["params"]  # but other dropout masks: not the same run
