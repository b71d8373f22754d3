"""Speculative decoding on one screen: a plain loop over one sequence, chain or tree, greedy or sampled.

What it is for: the readable statement of what the batched worker does (specdec/spec_decode/
spec_decode_worker.py with Top1Proposer, scorers/mqa.py, scorers/tree.py and specdec/verify/) for one
request. tests/test_reference.py proves that they agree token for token: greedy, and sampled with a seed
(a seeded request draws its randomness here exactly as the worker draws it: the proposer's own draws, then
per step the acceptance coins, then one Exp(1) row for the final token).

One step: draft k tokens (or a tree) after the pending token, the last committed token the target has not
run yet; one target pass over [pending, drafts]; accept / recover / bonus; keep only the pending token and
the accepted path in the target's KV; tell the proposer what was accepted; repeat until max_tokens or EOS.

The accept rules are written out here, not called from specdec/verify, so the test checks the verifiers'
kernels as well. ``verify_chain`` is specdec_kernels/rejection.py's rule (the recovered token races the unnormalised
max(p - q, 0)); ``verify_tree`` is verify/tree.py's (each rejection normalises the residual, which the next
sibling needs): the same law, but the last bit of a race can differ, so each follows its own verifier exactly.

It knows nothing about batching, more than one slot, scheduling, transactions, logits processors
(penalties, biases, masks, min_tokens), logprobs, stop strings or ids, max_model_len, disable_by_batch_size
or non-finite logits. Proposers that read the target's hidden states (EAGLE, EAGLE-3, Medusa, MLP
speculator: a FeatureSpec) are out of scope, because their rows travel in HiddenStates, which this loop does
not keep; every other Proposer (ngram, draft_model, layer_skip) and TreeProposer (tree_draft) runs here.
"""

from __future__ import annotations

import torch

from specdec.datamodel.sampling_params import SamplingParams
from specdec.engine import ForwardBatch, ModelEngine
from specdec.sampling.sampler import SamplingTensors
from specdec.spec_decode.proposer import ProposeBatch, Proposer, TreeShape

__all__ = ["generate"]

SEQ = 0  # the one sequence's id, as the proposer knows it


@torch.no_grad()
def generate(target: ModelEngine, proposer: Proposer, prompt: list[int], params: SamplingParams, *, k: int = 4,
             shape: TreeShape | None = None, eos_token_id: int | None = None) -> list[int]:
    """Up to ``params.max_tokens`` tokens after ``prompt`` (fewer if ``eos_token_id`` comes): chains of ``k``
    drafts, or trees of ``shape`` when one is given (``proposer`` then a TreeProposer)."""
    if proposer.features is not None:
        raise ValueError(f"reference.generate: {type(proposer).__name__} reads the target's hidden states (a "
                         "FeatureSpec), which this loop does not keep; run it through LLM(speculative_config=...)")
    g = None if params.seed is None else torch.Generator().manual_seed(params.seed)
    V, slot = target.vocab_size, target.allocate_slot()
    try:
        # prefill the prompt's KV; the first token is plain sampling from its last row
        logits = target.forward(ForwardBatch(token_ids=torch.tensor(prompt), slots=[slot], query_lens=[len(prompt)],
                                             logits_indices=torch.tensor([len(prompt) - 1]))).logits  # [1, V]
        out = [int((probs(logits, params)[0] / noise(params, g, 0, V)[1]).argmax())]
        while out[-1] != eos_token_id and len(out) < params.max_tokens:
            tokens = prompt + out
            base = len(tokens)  # the target's KV holds base - 1 tokens: all but the pending one
            batch = ProposeBatch(seq_ids=[SEQ], token_ids=[tokens], k=k if shape is None else shape.depth,
                                 sampling_params=[params], generators=[g])
            # 1. draft: n tokens, node i drafted after node parents[i] (-1: the pending token; a chain: i - 1)
            if shape is None:
                d = proposer.propose(batch)
                n = min(k, int(d.lens[0]) if d.lens is not None else d.token_ids.shape[1])
                drafts, parents, q = d.token_ids[0, :n], torch.arange(n) - 1, d.probs
            else:
                t = proposer.propose_tree(batch, shape)
                n = int(t.num_nodes[0])
                drafts, parents, q = t.token_ids[0, :n], t.parents[0, :n], t.draft_probs
            # q: the law each draft was drawn from; None = deterministic drafts, q one-hot at the token
            q = torch.zeros(n, V).scatter_(1, drafts[:, None], 1.0) if q is None else q[0, :n].float()
            # 2. score: one target pass over [pending, drafts]; a tree's node sees the cached prefix and its own
            #    ancestors only, at position base - 1 + depth, so its logits are those of "prefix + its path"
            fb = ForwardBatch(token_ids=torch.cat([torch.tensor(tokens[-1:]), drafts]), slots=[slot],
                              query_lens=[n + 1])
            if shape is not None:
                seen = torch.eye(n + 1, dtype=torch.bool)  # [n+1, n+1] ancestor-or-self; node 0 = pending
                for i, pa in enumerate(parents.tolist(), 1):
                    seen[i] |= seen[pa + 1]
                fb.positions, fb.tree_mask = base - 1 + seen.sum(1) - 1, seen  # depth = ancestors
            p = probs(target.forward(fb).logits, params)  # [n+1, V] the target's law after each node
            # 3. verify (the worker's draws: a chain k coins, a tree budget + 1 of which node 0's goes unused)
            u, e = noise(params, g, k if shape is None else shape.budget + 1, V)
            if shape is None:
                path, last = verify_chain(p, drafts, q, u, e)
            else:
                path, last = verify_tree(p, drafts, parents, q, u[1:], e)
            # 4. keep the pending token and the accepted path in the KV: a prefix of the nodes (every chain)
            #    is a rollback; a path through later siblings is moved into place
            if path == list(range(len(path))):
                target.rollback(slot, base + len(path))
            else:
                target.compact(slot, torch.tensor(path) + base, base)
            proposer.accepted(SEQ, base, path)
            for tok in [int(drafts[i]) for i in path] + [last]:
                out.append(tok)
                if tok == eos_token_id or len(out) == params.max_tokens:
                    break
        return out
    finally:
        target.free_slot(slot)
        proposer.free(SEQ)


def verify_chain(p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor, u: torch.Tensor, e: torch.Tensor,
                 ) -> tuple[list[int], int]:  # p [n+1, V], drafts [n], q [n, V], u [k], e [V]
    """(accepted drafts 0..a-1, the token after them); Leviathan et al. 2023."""
    for i, x in enumerate(drafts.tolist()):
        # accept x with probability min(1, p(x) / q(x)): u < p/q <=> u q(x) < p(x); p(x) >= q(x): always
        if not u[i] * q[i, x] < p[i, x]:
            # rejected: the recovered token ~ norm(max(p - q, 0)), by the exponential race argmax(w / E)
            return list(range(i)), int(((p[i] - q[i]).clamp(min=0) / e).argmax())
    return list(range(len(drafts))), int((p[len(drafts)] / e).argmax())  # all accepted: the bonus ~ p


def verify_tree(p: torch.Tensor, drafts: torch.Tensor, parents: torch.Tensor, q: torch.Tensor, u: torch.Tensor,
                e: torch.Tensor) -> tuple[list[int], int]:  # p [n+1, V] (row i+1: after node i), q [n, V], u [n]
    """(the accepted root-to-node path, the token after it); SpecInfer's multi-draft rule: each sibling in
    turn is a chain step against what is left of p once the earlier siblings were rejected."""
    path, at, p_at = [], -1, p[0]
    while True:
        for i in [j for j, pa in enumerate(parents.tolist()) if pa == at]:  # at's children, in index order
            x = int(drafts[i])
            if u[i] * q[i, x] < p_at[x]:  # accepted: descend, the target's law after node i
                path, at, p_at = path + [i], i, p[i + 1]
                break
            r = (p_at - q[i]).clamp(min=0)  # rejected: the next sibling faces norm(max(p - q, 0))
            p_at = r / r.sum() if r.sum() > 0 else p_at
        else:  # no child left to try: the final token ~ the current law (after a leaf: the bonus)
            return path, int((p_at / e).argmax())


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:  # [N, V] -> [N, V]
    """The request's law at each row: temperature, top-k, top-p, min-p; temperature 0 = one-hot at the argmax."""
    return SamplingTensors.from_params([params]).expand(logits.shape[0]).to_probs(logits.float())


def noise(params: SamplingParams, g: torch.Generator | None, n: int, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n uniform coins, then one Exp(1) row for the exponential race. Greedy draws nothing: u = 0 and E = 1
    turn the rules above into exact greedy matching (accept iff p(x) > 0, i.e. x is the argmax)."""
    if params.temperature == 0:
        return torch.zeros(n), torch.ones(V)
    u = torch.rand(n, generator=g)
    return u, -torch.rand(V, generator=g).log()
