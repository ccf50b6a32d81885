"""``python -m ckptguard.cli ARGS`` in a new process, forked from run_ranks' fork server (torch and
ckptguard imported once) instead of a new interpreter that imports them again (2-3 s of CPU a call
on 2 cores). The child runs the module as ``-m`` does (``runpy``, as ``__main__``); an exception
that escapes it is printed as the interpreter would (a traceback, exit 1), a hang is killed at
``timeout`` and raises ``subprocess.TimeoutExpired``."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ckptguard.testing import run_ranks

CMD = [sys.executable, "-m", "ckptguard.cli"]


def _main(rank: int, world: int, argv: list[str], out: str, err: str) -> int:
    import runpy
    import traceback

    sys.stdout.flush()
    sys.stderr.flush()
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = ["-m", *argv]  # runpy puts the module's path first, as -m does
    try:
        runpy.run_module("ckptguard.cli", run_name="__main__", alter_sys=True)
        code = 0
    except (
        SystemExit
    ) as exc:  # as the interpreter exits on it: None 0, an int itself, anything else printed, 1
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def run_cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="ckptguard-cli-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        (res,) = run_ranks(
            _main, 1, [str(a) for a in args], str(out), str(err), timeout=timeout, distributed=False
        )
        stdout = out.read_text() if out.exists() else ""
        stderr = err.read_text() if err.exists() else ""
    if res.error_type == "HelperTimeout":
        raise subprocess.TimeoutExpired([*CMD, *args], timeout, stdout, stderr)
    if res.exitcode != 0:  # the process died (a signal): as subprocess reports it
        return subprocess.CompletedProcess([*CMD, *args], res.exitcode or -1, stdout, stderr)
    assert res.error_type is None, f"the CLI runner itself failed: {res.error_type}: {res.error}"
    return subprocess.CompletedProcess([*CMD, *args], res.value, stdout, stderr)
