"""MedusaProposer: Medusa heads draft a chain, or a static token tree, from the target's last hidden state.

Medusa (Cai et al. 2024): H heads sit on the target's last-layer hidden state h (after the final norm) at
the position that produced the pending token. Head i = ResBlocks ``x + SiLU(W x + b)`` then an LM head;
it predicts the token i+1 places after the pending one. The heads never see the drafts before theirs, so
one forward of all heads gives a whole proposal, and the proposer keeps no state (no KV cache): the
``HiddenStates`` row of each sequence is all it reads. After a bonus step a sequence has two rows
(second-last, last); only the last one, the state that produced the pending token, is used.

- **Chain** (``scorer=mqa``/``batch_expansion``): draft j = argmax of head j-1 (greedy rows), or a draw
  from q_j = the request's processed distribution of head j-1, returned as ``probs``: rejection sampling
  stays lossless (q_j does not depend on the earlier drafts, which the rule does not need). With
  ``acceptance_method=typical_acceptance`` this is Medusa's own (lossy when sampling) scheme.
- **Static tree** (``scorer=tree``): Medusa's tree of top-k candidates. A node is a path of ranks
  (r_1, ..., r_d): its token is the r_d-th most likely token of head d-1 and its parent is
  (r_1, ..., r_{d-1}). The *shape* is fixed per run: ``options.medusa_choices`` (Medusa's list of paths,
  e.g. ``[[0], [0, 0], [1], ...]``) or, by default, the tree Medusa's ``generate_medusa_tree`` builds:
  best-first by expected acceptance = product over the path of the head's top-r accuracy, from the
  head's measured ``topk_accuracy`` (config.json, written by experiments/train/medusa.py) or a prior,
  within the shape's depth, top-k and node budget. Nodes are deterministic (one-hot q), so the tree
  verifier is lossless for sampled requests too.

speculative_config: ``model`` or ``options.head`` = a Medusa directory/file in a published layout
(the network and readers: ``specdec/heads/medusa.py``; ``tiny-random-llama`` = seeded random heads shaped
like the target);
``options.head_module`` = an in-process :class:`MedusaHeads` (tests); ``options.num_heads`` for random
heads. Knows nothing about verification or KV caches.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from specdec.engine import ModelEngine
from specdec.heads.common import CHECKPOINTS, LMHeadRows, load_head_module
from specdec.heads.medusa import MedusaConfig, MedusaHeads, check_medusa_fits, load_medusa, random_medusa
from specdec.sampling.sampler import SamplingTensors
from specdec.datamodel.sampling_params import SamplingParams
from specdec.spec_decode.draft_sampling import greedy_free, sample_draft
from specdec.spec_decode.proposer import DraftOutput, FeatureSpec, ProposeBatch
from specdec.spec_decode.registry import resolve
from specdec.spec_decode.proposer import TreeProposals, TreeProposer, TreeShape

__all__ = ["MedusaProposer", "medusa_tree"]

DEFAULT_HEAD = CHECKPOINTS / "smollm2-135m-instruct-medusa"
_GREEDY = SamplingParams(temperature=0.0)
# Prior top-r accuracy of head i when a head ships no measured one: 0.6 * 0.75^i / (r + 1). The shape
# (falling with depth and rank) is what the Medusa paper's Fig. 4 shows for Vicuna heads; the numbers are
# only a starting point, since the tree built from them is fixed: train_medusa.py writes measured ones.
_PRIOR_TOP1, _PRIOR_DECAY = 0.6, 0.75


def medusa_tree(accuracy: Sequence[Sequence[float]],  # [H][K] top-r accuracy of head i at rank r
                shape: TreeShape) -> list[tuple[int, ...]]:
    """Medusa's static tree: the ``shape.budget`` rank paths of highest expected acceptance (product of
    the accuracies along the path), depth <= shape.depth, ranks < shape.topk; best-first, so every kept
    path's parent and earlier siblings are kept. Sorted by (depth, path): a parent precedes its children."""
    depth = min(shape.depth, len(accuracy))
    topk = min([shape.topk] + [len(a) for a in accuracy[:depth]])

    def score(path: tuple[int, ...]) -> float:
        s = 1.0
        for d, r in enumerate(path):
            s *= accuracy[d][r]
        return s

    seen, kept = {(0,)}, []
    heap = [(-score((0,)), (0,))]
    while heap and len(kept) < shape.budget:
        _, path = heapq.heappop(heap)
        kept.append(path)
        nxt = [path[:-1] + (path[-1] + 1,)] if path[-1] + 1 < topk else []  # the next sibling
        if len(path) < depth:
            nxt.append(path + (0,))  # the first child
        for p in nxt:
            if p not in seen:
                seen.add(p)
                heapq.heappush(heap, (-score(p), p))
    return sorted(kept, key=lambda p: (len(p), p))


def _prior_accuracy(num_heads: int, topk: int) -> list[list[float]]:
    return [[_PRIOR_TOP1 * _PRIOR_DECAY ** i / (r + 1) for r in range(topk)] for i in range(num_heads)]


class MedusaProposer(TreeProposer):
    """Medusa heads as a chain proposer and a static-tree :class:`TreeProposer` (module docstring)."""

    option_keys = frozenset({"head", "head_module", "medusa_choices", "num_heads", "seed"})  # read from config.options

    @classmethod
    def config_keys(cls, spec):
        return frozenset({"model"})  # the heads' checkpoint (options.head first)

    features = FeatureSpec(history=1)  # the state that produced the pending token

    def __init__(self, target: ModelEngine, config) -> None:
        super().__init__(target, config)
        opts = config.options
        heads = opts.get("head_module")
        self.head_name = "<in-process heads>"
        if heads is None:
            path = opts.get("head") or config.model or DEFAULT_HEAD
            self.head_name = str(path)
            heads = load_head_module(path, "MedusaProposer", load_medusa, lambda: self._random(opts),
                                     "train one with python -m experiments.train.medusa ... export=<dir>")
        self.heads: MedusaHeads = heads
        c = heads.cfg
        check_medusa_fits(c, target.hidden_size, target.vocab_size, self.head_name)
        tree = resolve("scorer", config.scorer).drafts_trees
        what, need = (("tree_depth", config.tree_depth or config.num_speculative_tokens) if tree
                      else ("num_speculative_tokens", config.num_speculative_tokens))
        if need > c.num_heads:
            raise ValueError(f"MedusaProposer: {what}={need} but head {self.head_name} has num_heads={c.num_heads}; "
                             f"Medusa drafts at most one token per head: use {what} <= {c.num_heads}")
        self.heads.to(device=target.device, dtype=target.dtype).eval()
        tm = heads.token_map
        self.token_map = None if tm is None else tm.to(target.device)  # [Vd] draft id -> target id
        self.target_lm = None if heads.lm_heads else LMHeadRows(target, self.token_map).weight
        self.choices = opts.get("medusa_choices")
        self._trees: dict[TreeShape, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _random(self, opts) -> MedusaHeads:
        cfg = self.config
        n = opts.get("num_heads") or max(cfg.num_speculative_tokens, cfg.tree_depth or 0)
        return random_medusa(MedusaConfig(num_heads=n, hidden_size=self.target.hidden_size,
                                          vocab_size=self.target.vocab_size, own_lm_head=False),
                             seed=opts.get("seed", 0))

    # ------------------------------------------------------------------ drafting
    def draft_logits(self, h: torch.Tensor, n: int) -> torch.Tensor:
        """[B, D] -> [n, B, Vd] float32 logits of the first n heads over the draft vocabulary."""
        with torch.inference_mode():
            return self.heads.logits(h.to(self.target.device, self.target.dtype), n, self.target_lm)

    @staticmethod
    def _last_rows(batch: ProposeBatch) -> torch.Tensor:
        """[B, D] each sequence's last feature row: the state that produced its pending token."""
        return torch.stack([rows[-1] for rows in batch.feature_rows()])

    def _to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.token_map is None else self.token_map[ids]

    def propose(self, batch: ProposeBatch) -> DraftOutput:
        k = batch.k
        logits = self.draft_logits(self._last_rows(batch), k)  # [k, B, Vd]
        params = [p or _GREEDY for p in batch.sampling_params]
        st = SamplingTensors.from_params(params, device=logits.device)
        gens = greedy_free(params, batch.generators)
        toks, qs = zip(*(sample_draft(logits[j], st, gens, self.config.kernel) for j in range(k)))
        probs = None
        if not st.all_greedy:
            probs = torch.stack(qs, 1)  # [B, k, Vd]
            if self.token_map is not None:  # the draft vocabulary's q inside the target's
                probs = probs.new_zeros(*probs.shape[:2], self.target.vocab_size).index_copy_(2, self.token_map, probs)
        return DraftOutput(token_ids=self._to_target(torch.stack(toks, 1)), probs=probs)

    # ------------------------------------------------------------------ static tree
    def static_tree(self, shape: TreeShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(parents [N], head [N], rank [N]) of the fixed tree for this shape (module docstring)."""
        if shape in self._trees:
            return self._trees[shape]
        c = self.heads.cfg
        if self.choices is not None:
            paths = sorted({tuple(int(r) for r in p) for p in self.choices}, key=lambda p: (len(p), p))
            where = f"options.medusa_choices ({len(paths)} paths)"
            if len(paths) > shape.budget:
                raise ValueError(f"MedusaProposer: {where} exceed tree_budget={shape.budget}; raise tree_budget")
            for p in paths:
                if not p or len(p) > min(shape.depth, c.num_heads) or min(p) < 0 or (len(p) > 1 and p[:-1] not in paths):
                    raise ValueError(f"MedusaProposer: {where}: path {list(p)} needs 1 <= length <= min(tree_depth="
                                     f"{shape.depth}, num_heads={c.num_heads}), ranks >= 0 and its parent path")
        else:
            acc = c.topk_accuracy or _prior_accuracy(c.num_heads, shape.topk)
            paths = medusa_tree(acc, shape)
        index = {p: i for i, p in enumerate(paths)}
        parents = torch.tensor([index[p[:-1]] if len(p) > 1 else -1 for p in paths], dtype=torch.long)
        head = torch.tensor([len(p) - 1 for p in paths], dtype=torch.long)
        rank = torch.tensor([p[-1] for p in paths], dtype=torch.long)
        self._trees[shape] = parents, head, rank
        return self._trees[shape]

    def propose_tree(self, batch: ProposeBatch, shape: TreeShape) -> TreeProposals:
        B = len(batch.seq_ids)
        parents, head, rank = self.static_tree(shape)
        N = len(parents)
        logits = self.draft_logits(self._last_rows(batch), int(head.max()) + 1)  # [n, B, Vd]
        top = logits.topk(int(rank.max()) + 1, dim=-1).indices  # [n, B, R]
        picked = self._to_target(top[head.to(top.device), :, rank.to(top.device)])  # [N, B]
        return TreeProposals(token_ids=picked.T.cpu(), parents=parents.expand(B, N).clone(),
                             num_nodes=torch.full((B,), N, dtype=torch.long))

    def tree_lookahead(self, shape: TreeShape) -> int:
        return 0  # no cache of its own
