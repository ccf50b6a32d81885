"""`make test` builds the framework venvs in the background: a test that needs one waits for its
build (tests/venvs.py), runs on a venv whose build finished, and skips, with the reason, on one that
failed."""

from __future__ import annotations

import subprocess
import threading
import time

import venvs


def test_a_venv_being_built_is_waited_for_then_found_or_not(tmp_path, monkeypatch):
    python = tmp_path / ".venv-x" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    monkeypatch.setattr(venvs, "BUILDING", tmp_path / "pid")
    assert not venvs.ready(python)  # no stamp: its build did not finish
    build = subprocess.Popen(["sleep", "1.5"])
    threading.Thread(
        target=build.wait, daemon=True
    ).start()  # reaped when it ends, as init reaps make's build
    (tmp_path / "pid").write_text(str(build.pid))
    started = time.monotonic()
    venvs.wait_for(python, timeout_s=30)  # the build still runs: waits until it ends
    assert time.monotonic() - started >= 1.0 and build.poll() is not None
    assert not venvs.ready(
        python
    )  # the build ended without the stamp: a failed build, the tests skip
    (python.parent.parent / ".installed").write_text("")
    started = time.monotonic()
    venvs.wait_for(python)
    assert venvs.ready(python) and time.monotonic() - started < 0.5  # stamped: no wait
