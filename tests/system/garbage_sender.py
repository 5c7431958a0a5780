"""A hostile sender for the system tests: the real sender service, except that every context it
captures is replaced by finite garbage of the right layout before it is stored, announced and
served (so the bulk channel's checksums vouch for the garbage, and every range check passes).

Run as `start_service`'s `wrap` prefix:
  python garbage_sender.py KIND ITEMS -- python -m droidmesh.services.sender --nats-url ...
KIND: one of KINDS; ITEMS: "kv" (every layer's K and V), "e" (every captured E) or "all".
`garble` is also what the unit tests feed the screen.
"""

from __future__ import annotations

import dataclasses
import runpy
import sys

import torch

from droidmesh.shared.kv.blocks import CapturedContext, KVBlock

KINDS = ("zeros", "flipped", "random")


def garble(t: torch.Tensor, kind: str, seed: int = 0) -> torch.Tensor:
    """`t` as garbage of `kind`: all zeros; sign-flipped; or iid normal noise at `t`'s own rms
    (the right scale, no structure). Same shape, dtype and device."""
    if kind == "zeros":
        return torch.zeros_like(t)
    if kind == "flipped":
        return -t
    if kind == "random":
        g = torch.Generator().manual_seed(seed)
        rms = t.float().square().mean().sqrt().cpu()
        return (torch.randn(t.shape, generator=g) * rms).to(device=t.device, dtype=t.dtype)
    raise ValueError(f"unknown garbage {kind!r}; expected one of {KINDS}")


def garble_context(captured: CapturedContext, kind: str, items: str) -> CapturedContext:
    kv, e = captured.kv, captured.e
    if items in ("kv", "all"):
        kv = tuple(KVBlock(b.layer, garble(b.k, kind, 2 * b.layer), garble(b.v, kind, 2 * b.layer + 1)) for b in kv)
    if items in ("e", "all"):
        e = {l: garble(t, kind, 1000 + l) for l, t in e.items()}
    return dataclasses.replace(captured, kv=kv, e=e)


def main(argv: list[str]) -> None:
    kind, items, sep, _python, flag, module, *args = argv
    if sep != "--" or flag != "-m" or items not in ("kv", "e", "all") or kind not in KINDS:
        raise SystemExit(f"usage: garbage_sender.py {{{','.join(KINDS)}}} {{kv,e,all}} -- python -m MODULE ARGS...")
    from droidmesh.services.sender import handlers

    honest = handlers.capture_prefill

    def hostile(*a, **kw) -> CapturedContext:
        return garble_context(honest(*a, **kw), kind, items)

    handlers.capture_prefill = hostile  # what the sender's `_capture` calls before placing and serving
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
