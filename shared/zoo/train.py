"""Training loops for the zoo: staged pretraining, layer growth, partial / LoRA fine-tunes.

Everything is a pure function of (recipe, seed): batches come from `random.Random` seeded per
(stage, step), the model from `torch.manual_seed`, and training runs on a fixed thread count,
so the same recipe gives bit-identical weights on the same machine.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from droidmesh.shared.tasks import vocab as V
from droidmesh.shared.tasks.synthetic import (
    context_seq,
    echo_seq,
    lookup_block,
    make_context,
    repeat_seq,
    titles_block,
)
from droidmesh.shared.zoo.tokenizer import WordIds


@dataclasses.dataclass(frozen=True)
class Arch:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    max_positions: int = 4096
    rope_theta: float = 10000.0


@dataclasses.dataclass(frozen=True)
class Stage:
    """One training stage. `mix` maps a sequence kind to its sampling weight:
    echo | recall | ask | who | titles | code."""

    name: str
    steps: int
    lr: float
    batch: int
    mix: tuple[tuple[str, float], ...]
    facts: tuple[int, int] = (2, 4)       # facts per context, inclusive range
    docs: tuple[int, int] = (1, 1)
    filler: tuple[int, int] = (0, 0)      # filler words per context
    lookups: int = 8                      # questions per sequence
    coded_frac: float = 0.0               # share of contexts with the `coded` header
    train: str = "all"                    # all | layers:<i,j,..>+alias | lora
    freeze_attn0: bool = False
    bare: bool = False                    # contexts without header / titles (stage-1 style docs)
    order: str = "kv"                     # fact word order, see tasks.make_context
    seq_len: int = 256                    # code windows (kind "code")
    attn_sup: float = 0.0                 # weight of the attention-supervision loss (see below)
    attn_layer: int = 1                   # the layer whose heads are supervised
    warmup: int = 20
    weight_decay: float = 0.0


FAMILIES = ("llama", "qwen2")
"""Architectures a zoo model may have: the demo tier's Llama, and Qwen2 for a model of another
family (q/k/v bias but no o bias, its own defaults), both supported by the engine's adapter."""


def model_config(arch: Arch, vocab_size: int, ids: WordIds, family: str = "llama") -> LlamaConfig | Qwen2Config:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; expected one of {FAMILIES}")
    # Keyword arguments through a dict: transformers' typed __init__ omits kwargs it accepts
    # (rope_theta, attn_implementation), which mypy would reject.
    kw: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=arch.hidden,
        intermediate_size=arch.intermediate,
        num_hidden_layers=arch.layers,
        num_attention_heads=arch.heads,
        num_key_value_heads=arch.kv_heads,
        max_position_embeddings=arch.max_positions,
        rope_theta=arch.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=ids.bos,
        eos_token_id=ids.eos,
        pad_token_id=ids.pad,
        attn_implementation="sdpa",
    )
    if family == "qwen2":
        return Qwen2Config(**kw, use_sliding_window=False)
    return LlamaConfig(**kw, attention_bias=True)  # bias helps small models learn the retrieval


def new_model(arch: Arch, ids: WordIds, seed: int, family: str = "llama") -> LlamaForCausalLM:
    """A fresh float32 model (a Qwen2 model where `family` says so: the same module layout)."""
    torch.manual_seed(seed)
    cfg = model_config(arch, ids.vocab_size, ids, family)
    model: Any = Qwen2ForCausalLM(cfg) if isinstance(cfg, Qwen2Config) else LlamaForCausalLM(cfg)
    return model.float()


# -- batches -----------------------------------------------------------------------------------
def sample_sequence(stage: Stage, rng: random.Random, ids: WordIds, code_sampler=None) -> tuple[list[int], list[int]]:
    """One training sequence of `stage` as (token ids with <bos>, target mask)."""
    kinds, weights = zip(*stage.mix, strict=True)
    kind = rng.choices(kinds, weights)[0]
    if kind == "echo":
        words, mask = echo_seq(rng, units=max(4, stage.lookups))
        return _with_bos(ids, words, mask)
    if kind == "repeat":
        words, mask = repeat_seq(rng, rng.randint(6, 16))
        return _with_bos(ids, words, mask)
    if kind == "code":
        assert code_sampler is not None, "code stage needs a code sampler"
        return code_sampler(rng)
    header = V.CODED if rng.random() < stage.coded_frac else V.PLAIN
    ctx = make_context(
        rng, rng.randint(*stage.facts), rng.randint(*stage.docs), rng.randint(*stage.filler), header,
        with_titles=not stage.bare, order=stage.order,
    )
    if stage.bare:
        ctx.words = ctx.words[1:]
    block = titles_block(ctx) if kind == "titles" else lookup_block(ctx, rng, stage.lookups, kind)
    words, mask = context_seq(ctx, [block])
    return _with_bos(ids, words, mask)


def _with_bos(ids: WordIds, words: list[str], mask: list[int]) -> tuple[list[int], list[int]]:
    seq, target = ids.seq_mask(words, mask)
    return [ids.bos] + seq, [0] + target


def lookup_links(ids_seq: list[int], mask: list[int], ids: WordIds, order: str = "kv") -> list[tuple[int, int]]:
    """(query position, fact position) for each answer of a `recall`/`ask` sequence: the query is
    the key token right before the answer; the fact position is where that key's value sits in
    the context (order kv) or the key itself (order vk). Positions index `ids_seq`."""
    key_ids = {ids[k] for k in V.KEYS}
    first: dict[int, int] = {}
    for i, t in enumerate(ids_seq):
        if t in key_ids and t not in first:
            first[t] = i
    links = []
    for t, m in enumerate(mask):
        if m and t >= 1 and ids_seq[t - 1] in key_ids:
            k_pos = first[ids_seq[t - 1]]
            if k_pos < t - 1:
                links.append((t - 1, k_pos + 1 if order == "kv" else k_pos))
    return links


def make_batch(seqs: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest: input ids [B, T] and labels [B, T] (-100 = no loss)."""
    T = max(len(s) for s, _ in seqs)
    x = torch.full((len(seqs), T), pad, dtype=torch.long)
    y = torch.full((len(seqs), T), -100, dtype=torch.long)
    for i, (s, m) in enumerate(seqs):
        x[i, : len(s)] = torch.tensor(s)
        y[i, : len(s)] = torch.where(torch.tensor(m, dtype=torch.bool), torch.tensor(s), -100)
    return x, y


def stage_rng(seed: int, stage: str, step: int) -> random.Random:
    return random.Random(f"{seed}/{stage}/{step}")


# -- what trains -------------------------------------------------------------------------------
def select_trainable(model: LlamaForCausalLM, stage: Stage, ids: WordIds) -> tuple[list[torch.nn.Parameter], Callable[[], None]]:
    """Set requires_grad per `stage.train`; return (params, post-backward hook). The hook masks
    the embedding gradient to the alias rows when only aliases may move (the context never
    contains an alias, so the context's KV stays that of the frozen layers)."""
    for p in model.parameters():
        p.requires_grad_(stage.train == "all")

    def hook() -> None:  # no gradient to mask unless only the aliases may move
        return None

    if stage.train.startswith("layers:"):
        spec = stage.train.split(":", 1)[1]
        layer_part, _, extra = spec.partition("+")
        for i in (int(t) for t in layer_part.split(",") if t):
            for p in model.model.layers[i].parameters():
                p.requires_grad_(True)
        if extra == "alias":
            emb = model.model.embed_tokens.weight
            emb.requires_grad_(True)
            rows = torch.zeros(emb.shape[0], 1)
            rows[[ids[a] for a in V.ALIASES]] = 1.0

            def mask_alias_grad() -> None:
                if emb.grad is not None:
                    emb.grad.mul_(rows)

            hook = mask_alias_grad

    if stage.freeze_attn0:
        for p in model.model.layers[0].self_attn.parameters():
            p.requires_grad_(False)
    return [p for p in model.parameters() if p.requires_grad], hook


def attention_loss(att: torch.Tensor, seqs: list[tuple[list[int], list[int]]], ids: WordIds, order: str) -> torch.Tensor:
    """Attention supervision: -log of the head-averaged attention [B, H, T, T] that each lookup's
    query puts on its fact. Why: the plain answer loss reaches the binding only through the
    value-copying path, and small models park on the "answer any value of the document" saddle;
    this gives the query/key weights a direct gradient toward the right fact."""
    terms = []
    for b, (s, m) in enumerate(seqs):
        for q, f in lookup_links(s, m, ids, order):
            terms.append(-torch.log(att[b, :, q, f].mean() + 1e-6))
    return torch.stack(terms).mean() if terms else att.sum() * 0.0


def lr_at(stage: Stage, step: int) -> float:
    """Linear warm-up, then cosine down to 10% of the peak."""
    if step < stage.warmup:
        return stage.lr * (step + 1) / stage.warmup
    frac = (step - stage.warmup) / max(1, stage.steps - stage.warmup)
    return stage.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train_stage(
    model: torch.nn.Module,
    stage: Stage,
    ids: WordIds,
    seed: int,
    code_sampler=None,
    params: list[torch.nn.Parameter] | None = None,
    hook: Callable[[], None] | None = None,
    log: Callable[[str], None] | None = None,
    probe: Callable[[int], None] | None = None,
    probe_every: int = 200,
) -> list[float]:
    """Run `stage.steps` AdamW steps; return the loss curve."""
    if params is None:
        params, hook = select_trainable(model, stage, ids)  # type: ignore[arg-type]  # only LoRA (PEFT-wrapped) models pass `params`; the rest are Llama
    opt = torch.optim.AdamW(params, lr=stage.lr, betas=(0.9, 0.98), weight_decay=stage.weight_decay)
    model.train()
    cfg: Any = model.config  # torch's Module.__getattr__ hides the config's type from mypy
    impl = cfg._attn_implementation
    if stage.attn_sup > 0:
        cfg._attn_implementation = "eager"  # sdpa does not return attention weights
    try:
        return _train_loop(model, stage, ids, seed, code_sampler, params, opt, hook, log, probe, probe_every)
    finally:
        cfg._attn_implementation = impl
        model.eval()


def _train_loop(model, stage, ids, seed, code_sampler, params, opt, hook, log, probe, probe_every) -> list[float]:
    losses: list[float] = []
    bar = tqdm(range(stage.steps), desc=f"train {stage.name}", unit="step", leave=False)
    for step in bar:
        rng = stage_rng(seed, stage.name, step)
        seqs = [sample_sequence(stage, rng, ids, code_sampler) for _ in range(stage.batch)]
        x, y = make_batch(seqs, ids.pad)
        for g in opt.param_groups:
            g["lr"] = lr_at(stage, step)
        if stage.attn_sup > 0:
            out = model(input_ids=x, labels=y, output_attentions=True)
            loss = out.loss + stage.attn_sup * attention_loss(out.attentions[stage.attn_layer], seqs, ids, stage.order)
        else:
            out = model(input_ids=x, labels=y)
            loss = out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if hook is not None:
            hook()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(out.loss.item())
        if step % 10 == 0:
            bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}")
        if log is not None and (step + 1) % 100 == 0:
            log(f"{stage.name} step {step + 1} loss {sum(losses[-50:]) / len(losses[-50:]):.4f}")
        if probe is not None and (step + 1) % probe_every == 0:
            probe(step + 1)
            model.train()
    return losses


@torch.no_grad()
def answer_accuracy(model: torch.nn.Module, stage: Stage, ids: WordIds, seed: int, n: int = 64) -> dict[str, float]:
    """Held-out accuracy at every target position of `n` fresh sequences of `stage`'s mix, and
    the share of first answers that are at least SOME value (copy vs lookup)."""
    model.eval()
    values = torch.tensor([ids[v] for v in V.VALUES])
    hit = tot = some = 0
    for i in range(0, n, 16):
        seqs = [sample_sequence(stage, stage_rng(seed + 7919, stage.name + "/eval", i + j), ids) for j in range(min(16, n - i))]
        x, y = make_batch(seqs, ids.pad)
        pred = model(input_ids=x).logits[:, :-1].argmax(-1)  # [B, T-1]: prediction for token t+1
        tgt = y[:, 1:]
        m = tgt != -100
        hit += int((pred[m] == tgt[m]).sum())
        tot += int(m.sum())
        some += int(torch.isin(pred[m], values).sum())
    return {"acc": hit / max(1, tot), "some_value": some / max(1, tot)}


# -- growth ------------------------------------------------------------------------------------
@torch.no_grad()
def grow(model: LlamaForCausalLM, placement: list[int | None], ids: WordIds, seed: int) -> LlamaForCausalLM:
    """A deeper model: new layer i copies old layer placement[i], or (None) is a fresh layer whose
    o_proj and down_proj are zero, so it starts as the identity on the residual stream and the
    grown model computes exactly what the shallow one did."""
    old = model.config
    arch = Arch(len(placement), old.hidden_size, old.num_attention_heads, old.num_key_value_heads or old.num_attention_heads,
                old.intermediate_size, old.max_position_embeddings, _rope_theta(old))
    new = new_model(arch, ids, seed, model.config.model_type)
    new.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
    new.model.norm.weight.copy_(model.model.norm.weight)
    for i, src in enumerate(placement):
        layer = new.model.layers[i]
        if src is None:
            layer.self_attn.o_proj.weight.zero_()
            if layer.self_attn.o_proj.bias is not None:
                layer.self_attn.o_proj.bias.zero_()
            layer.mlp.down_proj.weight.zero_()
        else:
            layer.load_state_dict(model.model.layers[src].state_dict())
    new.tie_weights()
    return new


def _rope_theta(cfg: LlamaConfig) -> float:
    rp = getattr(cfg, "rope_parameters", None) or {}
    return float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


@torch.no_grad()
def init_aliases(model: LlamaForCausalLM, ids: WordIds) -> None:
    """Start each alias's embedding as a copy of its key's (vocabulary extension by initialising
    new tokens from related ones). Only question tokens ever contain aliases, so this changes
    nothing about how any context is encoded."""
    emb = model.model.embed_tokens.weight
    for k, a in zip(V.KEYS, V.ALIASES, strict=True):
        emb[ids[a]] = emb[ids[k]]
