"""Choosing the next token from a step's logits: greedy, or temperature + top-p (nucleus) sampling.

`make_sampler(temperature, top_p, seed, device)` returns a `Sampler`: a callable from one
position's logits [vocab] (float32, on `device`) to a token id. Called on the compute thread, once
per decoded token, in order.
  - temperature 0: `argmax`, exactly the engine's greedy decoding (top_p and seed are ignored);
  - temperature > 0: softmax(logits / temperature), restricted to the smallest set of most
    probable tokens whose mass reaches top_p (the top token is always kept), renormalised, then
    one draw from a `torch.Generator` private to the sampler, on the logits' device, seeded from
    `seed` (None: a fresh random seed). So the same seed, prompt and plan give the same tokens
    on the same device; nothing here touches torch's global RNG.
Ranges are checked here, once, for every service: a bad value is a `BadRequestError`.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import torch

from droidmesh.shared.errors import BadRequestError

Sampler = Callable[[torch.Tensor], int]

MAX_TEMPERATURE = 2.0
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes 64 bits; keep clear of the sign question


def check_sampling(temperature: float, top_p: float, seed: int | None = None) -> None:
    """Raise `BadRequestError` naming the first out-of-range value (NaN fails every check)."""
    if not (isinstance(temperature, int | float) and 0.0 <= temperature <= MAX_TEMPERATURE):
        raise BadRequestError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature!r}")
    if not (isinstance(top_p, int | float) and 0.0 < top_p <= 1.0):
        raise BadRequestError(f"top_p must be in (0, 1], got {top_p!r}")
    if seed is not None and not (isinstance(seed, int) and 0 <= seed <= MAX_SEED):
        raise BadRequestError(f"seed must be an integer in [0, 2**63 - 1], got {seed!r}")


def greedy(logits: torch.Tensor) -> int:
    """The engine's decoding before sampling existed: the highest logit (first on ties)."""
    return int(logits.argmax())


class NucleusSampler:
    """Temperature + top-p sampling with its own generator (one per request: requests never
    share random state, so one request's draws cannot shift another's)."""

    def __init__(self, temperature: float, top_p: float, seed: int, device: torch.device):
        if device.type == "cuda" and device.index is None:  # "cuda" means the current one; logits name theirs
            device = torch.device("cuda", torch.cuda.current_device())
        self.temperature, self.top_p, self.seed, self.device = float(temperature), float(top_p), seed, device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> int:
        if logits.dim() != 1 or logits.device != self.device:
            raise BadRequestError(f"sampler on {self.device} got logits {tuple(logits.shape)} on {logits.device}")
        probs = torch.softmax(logits.to(torch.float32) / self.temperature, dim=-1)  # [vocab] float32
        # stable: tied probabilities keep token order, so a seed replays the same draw.
        sorted_p, order = torch.sort(probs, descending=True, stable=True)  # [vocab] each
        if self.top_p < 1.0:
            before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of strictly more probable tokens
            sorted_p = sorted_p.masked_fill(before >= self.top_p, 0.0)  # index 0 has before = 0: always kept
        pick = torch.multinomial(sorted_p, 1, generator=self.generator)  # [1] index into `order`
        return int(order[pick])


def make_sampler(temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 device: torch.device | str = "cpu") -> Sampler:
    """The sampler for one request; `device` is where the logits it receives live."""
    check_sampling(temperature, top_p, seed)
    if temperature == 0.0:
        return greedy
    return NucleusSampler(temperature, top_p, secrets.randbits(63) if seed is None else seed, torch.device(device))
