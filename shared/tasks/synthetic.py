"""Synthetic fact documents and the training / evaluation sequences built from them.

A context is a list of zoo words (one token each):
    <header> doc <title> <filler sentence> . <key> <value> . ... doc <title> ...
`header` is `plain` (a fact `k v .` means k -> v) or `coded` (it means k -> CODE[v], the
receiver's code). Keys are unique within a context, so a lookup has exactly one right fact;
filler words never collide with keys/values/titles, so only a fact can match a query.

Training sequences are (ids, mask) pairs: mask[t] = 1 where token t is a target (loss only on
answers); `<bos>` is prepended by the caller.
"""

from __future__ import annotations

import dataclasses
import random

from droidmesh.shared.tasks import vocab as V

NV = len(V.VALUES)
# The receiver's code: written value i means value (5 i + 3) mod 16, a fixed derangement
# (5 i + 3 = i has no solution mod 16), so a coded fact never "accidentally" reads right.
CODE: dict[str, str] = {V.VALUES[i]: V.VALUES[(5 * i + 3) % NV] for i in range(NV)}
ALIAS_OF: dict[str, str] = dict(zip(V.KEYS, V.ALIASES, strict=True))  # key -> alias


@dataclasses.dataclass
class Context:
    words: list[str]
    facts: dict[str, str]  # key -> value as written in the context
    titles: list[str]
    header: str

    def true_value(self, key: str) -> str:
        """What the fact about `key` means under the context's header."""
        w = self.facts[key]
        return CODE[w] if self.header == V.CODED else w


def filler_sentence(rng: random.Random, lo: int = 3, hi: int = 9) -> list[str]:
    return [rng.choice(V.FILLER) for _ in range(rng.randint(lo, hi))] + [V.SEP]


def make_context(
    rng: random.Random,
    n_facts: int,
    n_docs: int = 1,
    filler_tokens: int = 0,
    header: str = V.PLAIN,
    with_titles: bool = True,
    order: str = "kv",
) -> Context:
    """`n_facts` facts (unique keys) spread over `n_docs` documents, padded with about
    `filler_tokens` filler words placed between facts at random."""
    keys = rng.sample(V.KEYS, n_facts)
    facts = {k: rng.choice(V.VALUES) for k in keys}
    titles = rng.sample(V.TITLES, n_docs)
    # Split facts and filler sentences over the documents, then shuffle within each document.
    per_doc: list[list[list[str]]] = [[] for _ in range(n_docs)]
    for i, k in enumerate(keys):
        # order "vk" writes `value key .`: a lookup then matches the key token itself and reads
        # the value that layer 0's previous-token heads copied onto it.
        pair = [k, facts[k]] if order == "kv" else [facts[k], k]
        per_doc[i % n_docs].append(pair + [V.SEP])
    budget = filler_tokens
    while budget > 0:
        s = filler_sentence(rng)
        per_doc[rng.randrange(n_docs)].append(s)
        budget -= len(s)
    words: list[str] = [header]
    for d in range(n_docs):
        rng.shuffle(per_doc[d])
        if with_titles:
            words += [V.DOC, titles[d]]
        for sent in per_doc[d]:
            words += sent
    return Context(words, facts, titles, header)


# -- pretraining sequences ---------------------------------------------------------------------
def echo_seq(rng: random.Random, units: int = 8) -> tuple[list[str], list[int]]:
    """`echo a b a . a b a . ...` with a, b drawn from keys and values alike; the target is the
    echoed a. Builds type-agnostic previous-token heads."""
    words, mask = [V.ECHO], [0]
    pool = V.KEYS + V.VALUES
    for _ in range(units):
        a, b = rng.choice(pool), rng.choice(pool)
        words += [a, b, a, V.SEP]
        mask += [0, 0, 1, 0]
    return words, mask


def repeat_seq(rng: random.Random, length: int = 12) -> tuple[list[str], list[int]]:
    """`echo x1 .. xn . x1 .. xn`: a random key/value sequence, then repeated; every token of the
    repeat after its first is a target. Classic induction-head training signal: each target
    needs "find the earlier occurrence of the current token, copy the token after it" -- the
    same circuit as a key -> value lookup, with n targets per sequence instead of a few."""
    pool = V.KEYS + V.VALUES
    xs = [rng.choice(pool) for _ in range(length)]
    words = [V.ECHO] + xs + [V.SEP] + xs
    mask = [0] * (length + 2) + [0] + [1] * (length - 1)
    return words, mask


def lookup_block(ctx: Context, rng: random.Random, n: int, kind: str) -> tuple[list[str], list[int]]:
    """Questions about `ctx` after it. kind: recall (`recall k v . k v .`), ask (`ask k v .`),
    who (`who alias v .`, answer = the true value under the header)."""
    keys = list(ctx.facts)
    words: list[str] = [V.RECALL] if kind == "recall" else []
    mask: list[int] = [0] * len(words)
    for _ in range(n):
        k = rng.choice(keys)
        if kind == "recall":
            # `k v .`: the separator keeps the previous answer out of the next query's
            # previous-token features (else the query also "matches" that value's position).
            words += [k, ctx.facts[k], V.SEP]
            mask += [0, 1, 0]
        elif kind == "ask":
            words += [V.ASK, k, ctx.true_value(k), V.SEP]
            mask += [0, 0, 1, 0]
        elif kind == "who":
            # Only the value is a target: with one trainable layer, a closing "." target
            # competes with the code rule (the receiver then applies the code to plain
            # contexts too). QA answers are single words, so the task decodes one token.
            words += [V.WHO, ALIAS_OF[k], ctx.true_value(k), V.SEP]
            mask += [0, 0, 1, 0]
        else:
            raise ValueError(kind)
    return words, mask


def titles_block(ctx: Context) -> tuple[list[str], list[int]]:
    """`titles T1 T2 ... end`: the summarization-like answer, all of it a target."""
    words = [V.TITLES_Q] + ctx.titles + [V.END]
    return words, [0] + [1] * (len(ctx.titles) + 1)


def context_seq(ctx: Context, blocks: list[tuple[list[str], list[int]]]) -> tuple[list[str], list[int]]:
    words, mask = list(ctx.words), [0] * len(ctx.words)
    for w, m in blocks:
        words += w
        mask += m
    return words, mask
