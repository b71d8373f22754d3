"""Prompts the target writes itself from seed tasks, Self-Instruct style (Wang et al. 2023): show it a
numbered list of example tasks as plain text and let it continue the list; keep the new items that pass
the filters and are not near-duplicates.

As in the paper's prompt ("Come up with a series of tasks:"), the request is a raw-text list, not a chat
turn: asked in a chat turn, SmolLM2-135M-Instruct mostly answers "I'm ready to help" or writes a story
(2026-11-23: 5 usable of 256 requests), while continuing a list gives ~1 usable task per request. Each
list shows 4 human-written seeds and, from the second round on, 1 task the target wrote in an earlier round
(the paper mixes 6 + 2). Sampling: T = 0.8, top-p 0.9, one seed per request, so a build is reproducible
on the same engine and dtype. Filters: 4-60 words, starts with an imperative verb or a question word (as
instructions do), no refusal or meta-text, ends a sentence; then MinHash near-dup (dedup.py) against
everything already in the pool. It knows nothing about the other sources beyond the texts it de-dups against.
"""

from __future__ import annotations

import random
import re

from experiments.distill.dedup import MinHashDeduper

HEADER = "Come up with a series of tasks:\n\n"
_FIRST = set("""write explain list describe create give generate compose summarize summarise translate find calculate
suggest compare design plan tell identify classify convert rewrite make provide name imagine pretend develop outline
draft analyze analyse solve recommend help propose brainstorm evaluate discuss predict choose determine implement
come what how why which who when where can is are do does should if estimate rank sort edit correct paraphrase
prepare construct define build teach argue persuade convince invent complete fill count check decide""".split())
_BAD = re.compile(r"(as an ai|i'm sorry|i am sorry|i cannot|example task|new task|here is|here's|task \d|"
                  r"assistant|language model)", re.I)


def clean(text: str) -> str | None:
    """The task, or None if it fails the filters."""
    t = text.strip().strip('"').strip()
    words = t.split()
    if not 4 <= len(words) <= 60 or words[0].lower().strip(",:") not in _FIRST or _BAD.search(t):
        return None
    if not re.search(r"[.?!:)\"']$", t):
        return None
    return t


def list_items(prompt_tail: str, completion: str) -> list[str]:
    """The numbered items of a completed list (the last one only if the list went on after it)."""
    lines = (prompt_tail + completion).split("\n")
    items = [m.group(1) for ln in lines if (m := re.match(r"^\d+\.\s*(.+)$", ln.strip()))]
    return items


def self_instruct(llm, seeds: list[str], existing: list[str], n_requests: int, *, rounds: int = 4,
                  seed: int = 0, max_tokens: int = 128) -> list[str]:
    """``n_requests`` list continuations in ``rounds`` rounds; returns the tasks kept, in order."""
    from specdec import SamplingParams

    rng = random.Random(seed)
    dd = MinHashDeduper(0.7, seed)
    for t in existing:
        dd.add(t)
    kept: list[str] = []
    per_round = -(-n_requests // rounds)
    for r in range(rounds):
        prompts, params = [], []
        for i in range(per_round):
            ex = rng.sample(seeds, 4) + ([rng.choice(kept)] if kept else [])
            rng.shuffle(ex)
            prompts.append(HEADER + "".join(f"{j + 1}. {e}\n" for j, e in enumerate(ex)) + f"{len(ex) + 1}.")
            params.append(SamplingParams(temperature=0.8, top_p=0.9, seed=seed * 1_000_003 + r * per_round + i,
                                         max_tokens=max_tokens))
        outs = llm.generate(prompts, params)
        for p, o in zip(prompts, outs):
            c = o.outputs[0]
            items = list_items(p.rsplit("\n", 1)[1], c.text)
            if c.finish_reason != "stop" and items:
                items = items[:-1]  # cut off by the token limit
            for t in items:
                t = clean(t)
                if t is not None and dd.add(t):
                    kept.append(t)
        print(f"self-instruct round {r + 1}/{rounds}: {len(kept)} kept after {(r + 1) * per_round} requests", flush=True)
    return kept
