"""The README's demo block says what a demo run prints today: the manifest format it writes, and a
SIGKILLed rank called a SIGKILL (torchrun itself exits 1 when a worker dies of a signal)."""

from __future__ import annotations

import re
from pathlib import Path

from ckptguard._records.manifest import FORMAT_VERSION
from ckptguard.demo.job import describe_exit

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()

# What torchrun 2.13 printed for a worker that SIGKILLed itself (seen in a run of 2 workers).
TORCHRUN_LOG = [
    "E1201 21:02:59.777000 32094 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
    "(exitcode: -9) local_rank: 1 (pid: 32310) of binary: /usr/bin/python",
    "  exitcode  : -9 (pid: 32310)  (SIGKILL)",
    "  traceback : Signal 9 (SIGKILL) received by PID 32310",
]


def test_a_sigkilled_rank_is_called_a_sigkill():
    assert describe_exit(1, TORCHRUN_LOG) == "a rank was killed by SIGKILL; torchrun exited 1"
    assert describe_exit(-9, []) == "killed by SIGKILL"
    assert describe_exit(1, ["Traceback (most recent call last):", "ValueError: bad"]) == "exit 1"


def test_the_demo_block_shows_what_the_demo_prints():
    died = re.findall(r"the job died \((.*?)\);", README)
    assert died == [describe_exit(1, TORCHRUN_LOG)], died
    formats = re.findall(r"format written \[(\d+)\], read by format (\d+)", README)
    assert formats == [(str(FORMAT_VERSION), str(FORMAT_VERSION))], formats


def test_the_readme_names_the_fast_suite():
    assert "make test-fast" in README and "--durations" in README
