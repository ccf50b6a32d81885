"""`make test` builds the framework venvs in the background: a test that needs one waits for its
build (tests/venvs.py), runs on a venv whose build finished, and skips, with the reason, on one that
failed."""

from __future__ import annotations

import subprocess
import threading
import time

import venvs


def _build(pid_file) -> tuple[subprocess.Popen, threading.Thread]:
    """A build that runs until killed, reaped when it ends (as init reaps make's build)."""
    build = subprocess.Popen(["sleep", "300"])
    reaper = threading.Thread(target=build.wait, daemon=True)
    reaper.start()
    pid_file.write_text(str(build.pid))
    return build, reaper


def test_a_venv_being_built_is_waited_for_then_found_or_not(tmp_path, monkeypatch):
    python = tmp_path / ".venv-x" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    monkeypatch.setattr(venvs, "BUILDING", tmp_path / "pid")
    assert not venvs.ready(python)  # no stamp: its build did not finish
    build, reaper = _build(tmp_path / "pid")
    killed: list[float] = []

    def kill() -> None:
        killed.append(time.monotonic())
        build.kill()

    ends = threading.Timer(1.0, kill)  # the build ends while wait_for waits
    ends.start()
    try:
        venvs.wait_for(python, timeout_s=120)  # the build still runs: waits until it ends
        returned = time.monotonic()
    finally:
        ends.cancel()
        build.kill()
    reaper.join(30)
    assert killed and returned >= killed[0] and build.poll() is not None, (killed, returned)
    assert not venvs.ready(
        python
    )  # the build ended without the stamp: a failed build, the tests skip
    (python.parent.parent / ".installed").write_text("")
    # Stamped: no wait, though a build runs (one that waited returns only after the safety kill).
    build, reaper = _build(tmp_path / "pid")
    safety = threading.Timer(60, build.kill)
    safety.start()
    try:
        venvs.wait_for(python, timeout_s=120)
        still_running = venvs.building()  # the build's pid is alive (neither killed nor a zombie)
    finally:
        safety.cancel()
        build.kill()
        reaper.join(30)
    assert venvs.ready(python) and still_running
