"""The README's Usage block, run as written (only the root path replaced), on a model with a
Dropout.

``python tests/readme_usage_job.py ROOT KILL_AT [--no-generator]``: defines what the block leaves to
the reader (``model``, ``optim``, ``sched``, ``dataset``, ``train_step``, ``recipe``, ``registry``,
``total``) and runs the block; the ``KILL_AT``-th call of ``train_step`` in this launch SIGKILLs the
process (0: never). ``--no-generator`` drops the block's ``generator=torch.Generator()`` (the
negative control). Prints ``RESULT {json}``: the final step, tokens and the digests of the
parameters and the optimizer state."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

from ckptguard._disk.digest import digest  # bytes of every tensor, nested dicts, plain values

README = Path(__file__).resolve().parents[1] / "README.md"
GENERATOR = ",\n                    generator=torch.Generator())"


def usage_block(root: str, with_generator: bool) -> str:
    text = README.read_text()
    section = text[text.index("\n## Usage\n") :]
    block = section[section.index("```python\n") + len("```python\n") : section.index("\n```\n")]
    assert '"/ckpt/run1"' in block and GENERATOR in block, (
        "the README's Usage block changed: update this job"
    )
    block = block.replace('"/ckpt/run1"', repr(root))
    return block if with_generator else block.replace(GENERATOR, ")")


def main(root: str, kill_at: int, with_generator: bool) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1)
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=30, gamma=0.5)
    data = torch.Generator().manual_seed(1)
    # 56 samples in batches of 8: 7 steps an epoch, so the save at step 50 lands mid-epoch
    dataset = torch.utils.data.TensorDataset(
        torch.randn(56, 4, generator=data), torch.randn(56, 1, generator=data)
    )
    calls = [0]

    def train_step(batch) -> int:
        x, y = batch
        loss = torch.nn.functional.mse_loss(model(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return int(x.shape[0])

    ns = {
        "model": model,
        "optim": optim,
        "sched": sched,
        "dataset": dataset,
        "train_step": train_step,
        "recipe": {"lr": 1e-2, "batch": 8},
        "registry": None,
        "total": 120,
    }
    exec(compile(usage_block(root, with_generator), "README.md (Usage)", "exec"), ns)
    return {
        "step": ns["step"],
        "tokens": ns["tokens"],
        "params": digest(model.state_dict()),
        "optim": digest(optim.state_dict()),
        "start": ns["start"],
    }


if __name__ == "__main__":
    out = main(sys.argv[1], int(sys.argv[2]), "--no-generator" not in sys.argv[3:])
    print("RESULT " + json.dumps(out), flush=True)
