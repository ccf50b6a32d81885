"""Long operator commands show progress on a terminal and stay quiet otherwise.

Each command runs in a new process with its stderr on a pseudo-terminal (``pty``), then with stderr
on a pipe: on the terminal click's bar (label, ``[###...]``, percent) reaches 100%; on the pipe
stderr holds nothing. Under ``--json`` the terminal stays quiet too.
"""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import tempfile

import pytest

from cli_roots import build_roots

CLI = [sys.executable, "-m", "ckptguard.cli"]


def _on_terminal(*args: str) -> tuple[int, str, str]:
    """(exit code, what the terminal showed, stdout) of the CLI with its stderr on a pty."""
    master, slave = pty.openpty()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen([*CLI, *args], stdout=out, stderr=slave, stdin=subprocess.DEVNULL)
        os.close(slave)
        shown = []
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            shown.append(chunk)
        os.close(master)
        code = proc.wait(timeout=300)
        out.seek(0)
        return code, b"".join(shown).decode(errors="replace"), out.read().decode()


def _in_a_pipe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return build_roots(tmp_path_factory.mktemp("progress"))["one"]


@pytest.mark.parametrize(
    "args, label",
    [
        (["verify", "{root}"], "verify step_00000003"),
        (["verify", "{root}", "--deep"], "checksums"),
        (["gc", "{root}", "--dry-run"], "gc: checking steps 3/3"),
    ],
)
def test_progress_on_a_terminal_and_none_in_a_pipe(root, args, label):
    argv = [a.format(root=root) for a in args]
    code, shown, _ = _on_terminal(*argv)
    assert code == 0 and label in shown and "100%" in shown, shown
    piped = _in_a_pipe(*argv)
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr


def test_json_keeps_the_terminal_quiet(root):
    code, shown, out = _on_terminal("gc", str(root), "--dry-run", "--json")
    assert code == 0 and "%" not in shown and out.startswith("{"), shown


def test_transfer_shows_bytes_copied(root, tmp_path):
    code, shown, out = _on_terminal("transfer", str(root / "step_00000002"), str(tmp_path / "dest"))
    assert code == 0 and "transfer step_00000002" in shown and "100%" in shown, shown
    assert out.startswith("step 2: ")


@pytest.mark.slow
def test_repro_save_shows_its_rounds(tmp_path):
    code, shown, _ = _on_terminal(
        "repro-save", "--target", str(tmp_path / "t"), "--rounds", "2", "--size", "0.0001"
    )
    assert code == 0 and "target: rounds" in shown and "100%" in shown, shown
