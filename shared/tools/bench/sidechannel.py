"""`droidmesh bench sidechannel`: can a tenant tell, from timing alone, whether another tenant's
context is cached?

A mesh (nats-server under per-role users, broker, one sender, one receiver, the OpenAI gateway
with a key file) serves two phases. In each trial an operator prefills a fresh context into the
victim's scope (`tenant:victim`); the attacker then asks, through the gateway, either for that
context (cached) or for another fresh one of the same length (uncached), in shuffled order, and
times the request (`max_tokens` 1: its time is the time to first token as the attacker sees it).
Every trial prefills, cached or not, so the two labels differ in nothing but the attacker's prompt.

* before: the attacker's key has the victim's tenant: one scope, as every request had before
  scopes (what a reply's timing told anyone who sent the same prompt);
* after: the attacker's key is another tenant's.

With `holding`, nobody prefills as an operator: the victim asks its own question over the
context through the gateway, and the receiver holds what its prefill computed (in the victim's
scope), as it does for every request; the attacker then asks as above. No sender runs.

The attacker's best rule is a threshold on the time (`train_threshold`: any cut and either
direction, fitted on a stratified half of the trials); its accuracy on the other half, with a
Wilson interval (`wilson`), is the result. With scopes the interval should hold 0.5.

Called by `shared/tools/cli/bench/`; blocks for the run; every process is stopped at the end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from droidmesh.shared.auth import keys as api_keys
from droidmesh.shared.mesh.nats_auth import MeshAccess, Roster, receiver_user, sender_user
from droidmesh.shared.service.launch import Proc, start_service
from droidmesh.shared.service.localmesh import THREADS, launched_env, mesh
from droidmesh.shared.tasks.intervals import wilson

if TYPE_CHECKING:
    from droidmesh.shared.mesh.client import MeshClient

SENDER, RECEIVER, HOLDER = "sc-sender", "sc-receiver", "sc-receiver-hold"
VICTIM, ATTACKER = "victim", "attacker"
QUESTION = " who q"
VICTIM_QUESTION = " what q"  # the victim's own question (holding): its context is what is held
PHASES = {"before": VICTIM, "after": ATTACKER}  # phase -> the attacker key's tenant


def _accuracy(times: np.ndarray, cached: np.ndarray, threshold: float, faster: bool) -> float:
    guess = times < threshold if faster else times > threshold
    return float(np.mean(guess == cached))


def train_threshold(times: Sequence[float], cached: Sequence[bool]) -> dict[str, Any]:
    """The attacker's best rule on training trials: "cached if time < t" (or "> t", whichever
    direction fits better), t a midpoint between two observed times or beyond them all."""
    x, y = np.asarray(times, float), np.asarray(cached, bool)
    u = np.unique(x)
    cuts = [float(u[0]) - 1.0, *((u[:-1] + u[1:]) / 2).tolist(), float(u[-1]) + 1.0] if len(u) else [0.0]
    best = {"threshold_s": cuts[0], "faster_is_cached": True, "train_accuracy": -1.0}
    for t in cuts:
        for faster in (True, False):
            acc = _accuracy(x, y, t, faster)
            if acc > best["train_accuracy"]:
                best = {"threshold_s": t, "faster_is_cached": faster, "train_accuracy": acc}
    return best


def split(cached: Sequence[bool] | np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Stratified halves of the trial indices (train, test): each label split evenly."""
    rng = np.random.default_rng(seed)
    y = np.asarray(cached, bool)
    train, test = [], []
    for label in (True, False):
        idx = rng.permutation(np.flatnonzero(y == label))
        train += idx[: len(idx) // 2].tolist()
        test += idx[len(idx) // 2:].tolist()
    return np.array(sorted(train), int), np.array(sorted(test), int)


def evaluate(times: Sequence[float], cached: Sequence[bool], seed: int = 0) -> dict[str, Any]:
    """Train the threshold on one half, test it on the other: accuracy, its 95 % Wilson interval,
    and whether that interval holds 0.5 (chance)."""
    x, y = np.asarray(times, float), np.asarray(cached, bool)
    train, test = split(y, seed)
    rule = train_threshold(x[train], y[train])
    hits = int(round(_accuracy(x[test], y[test], rule["threshold_s"], rule["faster_is_cached"]) * len(test)))
    lo, hi = wilson(hits, len(test))
    med = lambda sel: float(np.median(x[sel])) if sel.any() else None  # noqa: E731
    return {**rule, "train_trials": len(train), "test_trials": len(test), "test_correct": hits,
            "accuracy": hits / len(test) if len(test) else None, "ci95": [lo, hi], "chance_in_ci": lo <= 0.5 <= hi,
            "median_cached_s": med(y), "median_uncached_s": med(~y)}


def _context(rng: np.random.Generator, words: int) -> str:
    from droidmesh.shared.tasks import vocab

    return " ".join(rng.choice(vocab.FILLER, words).tolist())


def _post(base: str, key: str, model: str, prompt: str, timeout_s: float) -> tuple[float, dict[str, Any]]:
    """Seconds one completion (max_tokens 1) took, as the client sees it, and its reply."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base}/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        reply = json.loads(r.read())
    return time.perf_counter() - t0, reply


def _until_listed(base: str, key: str, model: str, timeout_s: float = 60) -> None:
    """Wait until the gateway has discovered `model`'s receivers (it lists them in /v1/models)."""
    deadline = time.monotonic() + timeout_s
    while True:
        req = urllib.request.Request(f"{base}/models", headers={"Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                if model in [m["id"] for m in json.loads(r.read())["data"]]:
                    return
        except urllib.error.HTTPError as e:  # 503 until a receiver answers discovery
            if e.code != 503:
                raise
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gateway never listed {model}")
        time.sleep(0.2)


def _keys(path: Path) -> dict[str, str]:
    """A key per tenant (victim, attacker), unmetered for the run: tenant -> key."""
    out = {}
    for tenant in (VICTIM, ATTACKER):
        key, kid = api_keys.make_key()
        api_keys.append(path, api_keys.ApiKey(id=kid, digest=api_keys.digest(key), tenant=tenant, models=(RECEIVER,),
                                              requests_per_minute=10**6, tokens_per_minute=10**9, max_concurrent=4))
        out[tenant] = key
    return out


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a run serves: the sender's checkpoint (unused with `holding`), the receiver's, its
    default group (the recomputed layers of a reuse), and whether contexts come from the
    receiver's own holding of the victim's requests."""

    sender_path: str
    receiver_path: str
    group: tuple[int, int]
    device: str = "cpu"
    holding: bool = False
    phases: tuple[str, ...] = tuple(PHASES)


def run_sidechannel(setup: Setup, words: int, trials: int, warmup: int, seed: int,
                    say: Callable[[str], None]) -> dict[str, Any]:
    """Each phase on one mesh: per phase, `trials` cached and `trials` uncached requests (after
    `warmup` untimed ones). Returns {"phases": {phase: evaluate(...) + raw trials}, ...}."""
    from droidmesh.shared.model.adapter import load_model

    model = load_model(setup.receiver_path, device="cpu")  # tokenizer and fingerprint: when the broker has a context
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory(prefix="dm-bench-sidechannel-") as work:
        return _run(Path(work), model, rng, setup, words, trials, warmup, seed, say)


def _run(work: Path, model: Any, rng: np.random.Generator, setup: Setup, words: int, trials: int, warmup: int,
         seed: int, say: Callable[[str], None]) -> dict[str, Any]:
    keys = _keys(work / "keys.toml")
    victim_scope = next(k.scope for k in api_keys.load(work / "keys.toml").values() if k.tenant == VICTIM)
    result: dict[str, Any] = {"phases": {}, "holding": setup.holding}
    roster = Roster.local([] if setup.holding else [SENDER], [RECEIVER],
                          holders={RECEIVER: HOLDER} if setup.holding else None)
    with mesh(roster) as (access, procs):
        base = _start(access, procs, work / "keys.toml", setup)
        _until_listed(base, keys[VICTIM], RECEIVER)
        attack = _Attack(access, base, model, victim_scope, rng, words, trials, warmup, say,
                         keys[VICTIM] if setup.holding else None)
        for name, tenant in ((n, PHASES[n]) for n in setup.phases):
            say(f"sidechannel {name}: attacker's key is tenant {tenant!r}, the victim's contexts are {victim_scope!r}")
            rows = asyncio.run(attack.phase(name, keys[tenant]))
            result["phases"][name] = _phase_result(tenant, rows, seed)
    return result


def _start(access: MeshAccess, procs: list[Proc], keys_file: Path, setup: Setup) -> str:
    """Broker, sender (unless holding), receiver (on a default group; holding under HOLDER or not at
    all) and the gateway with `keys_file`; its OpenAI base URL."""
    url, env = access.url, launched_env(setup.device)
    procs.append(start_service("cache_broker", {}, url, env={**THREADS, **access.env_for("broker")}))
    if not setup.holding:
        procs.append(start_service("sender", {"model_path": setup.sender_path, "model_id": SENDER, "sender_id": SENDER,
                                              "readers": [RECEIVER], "dtype": "bfloat16",
                                              "e_layers": [setup.group[0]]}, url,
                                   env={**env, **access.env_for(sender_user(SENDER))}))
    hold = {"holder_id": HOLDER} if setup.holding else {"hold": False}
    procs.append(start_service("receiver", {"model_path": setup.receiver_path, "model_id": RECEIVER, "dtype": "bfloat16",
                                            "default_group": list(setup.group), **hold}, url,
                               env={**env, **access.env_for(receiver_user(RECEIVER))}))
    procs.append(start_service("gateway", {"http_port": 0, "api_keys": keys_file}, url,
                               env={**THREADS, **access.env_for("gateway")}))
    return f"http://127.0.0.1:{procs[-1].events('gateway_started')[0]['http_port']}/v1"


@dataclasses.dataclass
class _Attack:
    """The trials of a phase: the victim's contexts prefilled as an operator, the attacker's
    requests through the gateway (`base`) with a phase's key."""

    access: MeshAccess
    base: str
    model: Any  # the receiver's tokenizer and fingerprint: when the broker holds a context
    victim_scope: str
    rng: np.random.Generator
    words: int
    trials: int
    warmup: int
    say: Callable[[str], None]
    victim_key: str | None = None  # holding: the victim asks itself, and the receiver holds its context

    async def prefill(self, ops: MeshClient, context: str) -> None:
        """Cache `context` for the victim (an operator's prefill into its scope, or, holding, the
        victim's own request); return once the broker answers it in that scope."""
        from droidmesh.shared.model import text

        if self.victim_key is None:
            await ops.prefill(SENDER, context, scope=self.victim_scope, timeout=300)
        else:
            await asyncio.to_thread(_post, self.base, self.victim_key, RECEIVER, context + VICTIM_QUESTION, 300)
        ids = text.context_ids(self.model.tokenizer, context)
        deadline = time.monotonic() + 60
        while (await ops.lookup(ids, self.model.fingerprint.id, scope=self.victim_scope)).holder is None:
            if time.monotonic() > deadline:
                raise TimeoutError("the broker never indexed a prefilled context")
            await asyncio.sleep(0.01)

    async def phase(self, name: str, key: str) -> list[dict[str, Any]]:
        """The phase's timed trials (after the untimed warmup ones), cached and uncached shuffled."""
        from droidmesh.shared.mesh.client import MeshClient

        ops = await MeshClient.connect(self.access.url, **self.access.options("admin"))  # filling a store: an operator's
        try:
            labels = [True] * self.trials + [False] * self.trials
            order = [True, False] * self.warmup + self.rng.permutation(labels).tolist()
            rows: list[dict[str, Any]] = []
            for i, cached in enumerate(order):
                victims = _context(self.rng, self.words)
                await self.prefill(ops, victims)
                prompt = (victims if cached else _context(self.rng, self.words)) + QUESTION
                s, reply = await asyncio.to_thread(_post, self.base, key, RECEIVER, prompt, 300)
                if i < 2 * self.warmup:
                    continue
                ext = reply.get("droidmesh") or {}
                rows.append({"cached": bool(cached), "seconds": s, "path": ext.get("path"),
                             "prompt_tokens": (reply.get("usage") or {}).get("prompt_tokens")})
                if len(rows) % 10 == 0:
                    self.say(f"sidechannel {name}: {len(rows)}/{len(labels)} trials")
            return rows
        finally:
            await ops.close()


def _phase_result(tenant: str, rows: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    """A phase's result: the attacker's threshold rule evaluated, the paths per label, the prompt size."""
    ev = evaluate([r["seconds"] for r in rows], [r["cached"] for r in rows], seed)
    paths: dict[str, dict[str, int]] = {"cached": {}, "uncached": {}}
    for r in rows:
        side = paths["cached" if r["cached"] else "uncached"]
        side[str(r["path"])] = side.get(str(r["path"]), 0) + 1
    tokens = [r["prompt_tokens"] for r in rows if r["prompt_tokens"]]
    return {"attacker_tenant": tenant, **ev, "paths": paths,
            "prompt_tokens": int(np.median(tokens)) if tokens else None, "trials": rows}


def table_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One printed row per phase."""
    out = []
    for name, p in result["phases"].items():
        out.append({"phase": name, "attacker": p["attacker_tenant"], "tokens": p["prompt_tokens"],
                    "test_trials": p["test_trials"], "median_cached_s": p["median_cached_s"],
                    "median_uncached_s": p["median_uncached_s"], "threshold_s": p["threshold_s"],
                    "accuracy": p["accuracy"], "ci95_lo": p["ci95"][0], "ci95_hi": p["ci95"][1],
                    "chance_in_ci": p["chance_in_ci"]})
    return out


COLUMNS = ["phase", "attacker", "tokens", "test_trials", "median_cached_s", "median_uncached_s", "threshold_s",
           "accuracy", "ci95_lo", "ci95_hi", "chance_in_ci"]
