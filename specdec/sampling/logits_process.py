"""Logits processors: the SamplingParams fields that reshape the target's logits, given each row's prefix.

``apply_processors(logits [N, V], prefixes, prompt_lens, params) -> logits [N, V]`` is pure (the input
is not modified) and applies, in this order, to the rows whose request has one of them on:

1. ``repetition_penalty`` r (CTRL, Keskar et al. 2019), over every token of prompt + output:
   ``l / r`` where ``l > 0``, ``l * r`` otherwise;
2. ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI), over the output so far:
   ``l - f * count(t) - p * [count(t) > 0]``;
3. ``logit_bias``: ``l + bias[t]``;
4. the masks, last so that nothing moves a masked logit: ``allowed_token_ids`` (every other id),
   ``bad_words_token_ids`` (a word's last token, wherever the output ends with the rest of it),
   ``min_tokens`` (EOS and ``stop_token_ids`` while the output is shorter than min_tokens).

A masked logit is ``MASKED`` (a large negative finite value), not -inf: the sampler reads a non-finite row
as broken logits (see specdec/sampling/sampler.py). ``prefixes[i]`` is row i's whole prefix, prompt then output so
far (under speculation: with the drafted tokens before that row's position); ``prompt_lens[i]`` splits it.

Knows nothing about speculation, models or text: bad words arrive already tokenized.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.datamodel.sampling_params import SamplingParams

# -1e30: exp() of it is 0 at any temperature >= 1e-8, and a row of 2**17 of them still sums to a finite
# float32 (~1.3e35 < 3.4e38), so the sampler's finiteness check holds.
MASKED = -1e30

PROCESSOR_FIELDS = ("min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                    "allowed_token_ids", "bad_words", "bad_words_token_ids")


def active_processor_fields(p: SamplingParams) -> list[str]:
    """The processor fields of ``p`` that are on (not at their neutral default)."""
    off = {"min_tokens": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    return [f for f in PROCESSOR_FIELDS if getattr(p, f) not in (off.get(f), None, [], {})]


def stop_ids_for_min_tokens(p: SamplingParams) -> list[int]:
    """The ids min_tokens keeps from being sampled: stop_token_ids and the EOS the engine attached."""
    eos = getattr(p, "_eos_token_id", None)
    return list(p.stop_token_ids) + ([] if eos is None or p.ignore_eos else [eos])


def apply_processors(
    logits: torch.Tensor,  # [N, V] float32
    prefixes: Sequence[Sequence[int]],  # [N] prompt + output so far, per row
    prompt_lens: Sequence[int],  # [N]
    params: Sequence[SamplingParams],  # [N]
) -> torch.Tensor:  # [N, V] float32, a new tensor (or ``logits`` itself when no row has a processor)
    N, V = logits.shape
    if not (len(prefixes) == len(prompt_lens) == len(params) == N):
        raise ValueError(f"apply_processors: logits have {N} rows but got {len(prefixes)} prefixes, "
                         f"{len(prompt_lens)} prompt_lens and {len(params)} SamplingParams; pass one of each per row")
    rows = [i for i, p in enumerate(params) if active_processor_fields(p)]
    if not rows:
        return logits
    out = logits.clone()
    dev = logits.device
    sub = out[rows]  # [R, V]
    outputs = [list(prefixes[i][prompt_lens[i]:]) for i in rows]
    ps = [params[i] for i in rows]

    def flat(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """[(row, token id)] -> (rows [M], ids [M]) int64, for one scatter over the whole batch."""
        t = torch.tensor(pairs, dtype=torch.long, device=dev).reshape(-1, 2)
        return t[:, 0], t[:, 1]

    rep = [p.repetition_penalty for p in ps]
    if any(r != 1.0 for r in rep):
        seen = torch.zeros_like(sub, dtype=torch.bool)  # [R, V] token in prompt + output
        seen[flat([(r, t) for r, i in enumerate(rows) for t in prefixes[i]])] = True
        pen = torch.tensor(rep, dtype=sub.dtype, device=dev)[:, None]  # [R, 1]
        sub = torch.where(seen, torch.where(sub > 0, sub / pen, sub * pen), sub)

    freq = [p.frequency_penalty for p in ps]
    pres = [p.presence_penalty for p in ps]
    if any(freq) or any(pres):
        counts = torch.zeros_like(sub)  # [R, V] occurrences in the output so far
        idx = flat([(r, t) for r, toks in enumerate(outputs) for t in toks])
        counts.index_put_(idx, torch.ones(len(idx[0]), dtype=sub.dtype, device=dev), accumulate=True)
        f = torch.tensor(freq, dtype=sub.dtype, device=dev)[:, None]  # [R, 1]
        pr = torch.tensor(pres, dtype=sub.dtype, device=dev)[:, None]  # [R, 1]
        sub = sub - f * counts - pr * (counts > 0).to(sub.dtype)

    if any(p.logit_bias for p in ps):
        idx = flat([(r, t) for r, p in enumerate(ps) for t in (p.logit_bias or {})])
        vals = torch.tensor([v for p in ps for v in (p.logit_bias or {}).values()], dtype=sub.dtype, device=dev)
        sub = sub.index_put(idx, vals, accumulate=True)

    allowed = [r for r, p in enumerate(ps) if p.allowed_token_ids]
    mask = torch.zeros_like(sub, dtype=torch.bool)  # [R, V] True = may not be sampled
    if allowed:
        keep = torch.zeros_like(sub, dtype=torch.bool)
        keep[flat([(r, t) for r in allowed for t in ps[r].allowed_token_ids])] = True
        mask[allowed] = ~keep[allowed]
    banned = []
    for r, p in enumerate(ps):
        for word in p.bad_words_token_ids or []:
            n = len(word) - 1
            if n == 0 or (len(outputs[r]) >= n and outputs[r][len(outputs[r]) - n:] == word[:-1]):
                banned.append((r, word[-1]))
        if len(outputs[r]) < p.min_tokens:
            banned.extend((r, t) for t in stop_ids_for_min_tokens(p))
    if banned:
        mask[flat(banned)] = True
    sub = sub.masked_fill(mask, MASKED)
    out[rows] = sub
    return out


def process_tree_logits(logits: torch.Tensor,  # [B, N+1, V] raw target logits, root-inclusive
                        proposals: SpeculativeProposals,
                        seq_data: Sequence,  # [B] each row's SequenceData (its tokens, the pending one last)
                        params: Sequence[SamplingParams],  # [B]
                        ) -> torch.Tensor:  # [B, N+1, V]: processed where a row's request has processors
    """Logits processors (specdec/sampling/logits_process.py) at every scored position of the rows that ask for them,
    each conditioned on its own prefix: the sequence, then the drafted tokens on the path from the root to
    that node. A chain's position j sees the first j drafts. Rows without processors are returned as is."""
    rows = [b for b, p in enumerate(params) if p is not None and active_processor_fields(p)]
    if not rows:
        return logits
    M = logits.shape[1]
    tokens, parents = proposals.token_ids.tolist(), proposals.parents.tolist()
    prefixes, prompt_lens, row_params = [], [], []
    for b in rows:
        base = seq_data[b].get_token_ids()
        paths: list[list[int]] = [[]]  # root-inclusive node i -> drafted tokens from the root to it
        for i in range(M - 1):
            par = parents[b][i]
            paths.append((paths[par + 1] if par >= 0 else []) + [tokens[b][i]] if tokens[b][i] >= 0 else [])
        prefixes += [base + path for path in paths]
        prompt_lens += [seq_data[b].get_prompt_len()] * M
        row_params += [params[b]] * M
    idx = torch.tensor(rows, device=logits.device)
    sub = apply_processors(logits.index_select(0, idx).reshape(len(rows) * M, -1), prefixes, prompt_lens,
                           row_params)  # [R * M, V]
    return logits.index_copy(0, idx, sub.view(len(rows), M, -1).to(logits.dtype))

