"""Shared fixtures: tiny random-init models of two families (MHA Llama, GQA Qwen2), and a
tiny on-disk sender/receiver pair with the zoo tokenizer for wiring tests.

Also the suite-wide settings: torch runs on one thread (tiny models gain nothing from more, and
one thread makes a computation repeat to the bit from run to run; across shapes and CPU vendors
the order of its sums still differs, which `tests/numeric.py` allows for), and tests marked
`gpu` are skipped where CUDA is absent.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import structlog


def _xdist_controller() -> bool:
    """Whether this process is a pytest-xdist controller (`-n N`, N not 0): it runs no test."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return False
    args = [*os.environ.get("PYTEST_ADDOPTS", "").split(), *sys.argv[1:]]
    for i, a in enumerate(args):
        if a in ("-n", "--numprocesses"):
            return i + 1 < len(args) and args[i + 1] != "0"
        if a.startswith("--numprocesses="):
            return a.split("=", 1)[1] != "0"
        if a.startswith("-n") and not a.startswith("--"):
            return a[2:] != "0"
    return False


# The controller loads this file before it starts its workers: torch and the model classes
# (~6 s) are imported only where tests run, so the workers do not wait for them.
_CONTROLLER = _xdist_controller()
if not _CONTROLLER:
    import torch

    from droidmesh.shared.model.adapter import ModelAdapter, load_model, random_model
    from droidmesh.shared.zoo.tokenizer import hf_tokenizer

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, vocab_size=97)
FAMILIES = {
    "llama": dict(TINY, num_key_value_heads=4),
    "qwen2": dict(TINY, num_key_value_heads=2),  # GQA, attention bias
}
ATOL = 1e-4  # float32 logits, max-abs-diff against the receiver's own full prefill

if not _CONTROLLER:
    torch.set_num_threads(1)

# In-process services log as they do in production (JSON lines, `configure_logging` when stderr is
# not a terminal), not through structlog's default development renderer: that one formats every
# logged exception as a syntax-highlighted traceback (~0.4 s each), which made a test of seven
# failing requests cost 3 s. No logger caching, so `structlog.testing.capture_logs` still sees
# every line.
structlog.configure(
    processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True), structlog.processors.format_exc_info,
                structlog.processors.JSONRenderer()],
    logger_factory=structlog.PrintLoggerFactory(),
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(params=sorted(FAMILIES), scope="module")
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def receiver(family: str) -> ModelAdapter:
    return random_model(family, seed=0, name="receiver", **FAMILIES[family])


def perturbed_copy(model: ModelAdapter, layers: range, scale: float = 0.05, seed: int = 1) -> ModelAdapter:
    """A sender equal to `model` except for noise added to the weights of `layers`."""
    sender = ModelAdapter(model=copy.deepcopy(model.model), tokenizer=None, name="sender")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in layers:
            for p in sender.model.model.layers[layer].parameters():
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return sender


@pytest.fixture(scope="module")
def prompt() -> tuple[list[int], list[int]]:
    """(context ids, question ids)."""
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 97, (48,), generator=g).tolist(), torch.randint(0, 97, (6,), generator=g).tolist()


def reference_logits(model: ModelAdapter, ids: list[int]) -> torch.Tensor:
    """The model's own HF forward over `ids` (no DroidMesh code on this path): [T, vocab]."""
    with torch.inference_mode():
        return model.model(input_ids=torch.tensor([ids], device=model.device)).logits[0].float()


def reference_greedy(model: ModelAdapter, ids: list[int], n: int) -> list[int]:
    """Greedy tokens from the model's own HF forward over the whole sequence each step (no cache:
    the reference must not share the engine's cache handling)."""
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            logits = model.model(input_ids=torch.tensor([ids + out], device=model.device), use_cache=False).logits
            out.append(int(logits[0, -1].argmax()))
    return out


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(sender dir, receiver dir): one random Llama, the sender perturbed in layers 2..3."""
    tok = hf_tokenizer()
    root = tmp_path_factory.mktemp("ckpt")
    recv = random_model("llama", seed=0, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                        max_position_embeddings=1024, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    send = copy.deepcopy(recv.model)
    with torch.no_grad():
        for layer in (2, 3):
            for p in send.model.layers[layer].parameters():
                p.add_(torch.randn_like(p) * 0.05)
    paths = root / "sender", root / "receiver"
    for model, path in ((send, paths[0]), (recv.model, paths[1])):
        model.save_pretrained(path)
        tok.save_pretrained(path)
    return paths


@pytest.fixture(scope="session")
def tiny_models(tiny_pair):
    return load_model(tiny_pair[0], name="sender"), load_model(tiny_pair[1], name="receiver")


@pytest.fixture(scope="session")
def ci_tier(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """(directory, manifest) of the zoo's ci tier, built once per session (~25 s, deterministic)."""
    from droidmesh.shared.zoo import build_tier

    out = tmp_path_factory.mktemp("zoo") / "ci"
    return out, build_tier("ci", out)
