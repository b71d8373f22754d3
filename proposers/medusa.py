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
  head's measured ``topk_accuracy`` (config.json, written by experiments/train_medusa.py) or a prior,
  within the shape's depth, top-k and node budget. Nodes are deterministic (one-hot q), so the tree
  verifier is lossless for sampled requests too.

speculative_config: ``model`` or ``options.head`` = a Medusa directory/file in a published layout
(``specdec/heads/medusa.py``; ``tiny-random-llama`` = seeded random heads shaped like the target);
``options.head_module`` = an in-process :class:`MedusaHeads` (tests); ``options.num_heads`` for random
heads. Knows nothing about verification or KV caches.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn as nn

from kernels.noise import draw_exponential
from specdec.engine import ModelEngine
from specdec.heads.medusa import MedusaConfig, check_medusa_fits, read_medusa
from specdec.sampling import SamplingTensors
from specdec.sampling_params import SamplingParams
from specdec.spec_decode.proposer import DraftOutput, ProposeBatch
from specdec.tree import TreeProposals, TreeProposer, TreeShape

__all__ = ["MedusaHeads", "MedusaProposer", "ResBlock", "load_medusa", "medusa_tree", "random_medusa"]

REPO = Path(__file__).resolve().parents[1]
DEFAULT_HEAD = REPO / "heads" / "smollm2-135m-instruct-medusa"
_GREEDY = SamplingParams(temperature=0.0)
# Prior top-r accuracy of head i when a head ships no measured one: 0.6 * 0.75^i / (r + 1). The shape
# (falling with depth and rank) is what the Medusa paper's Fig. 4 shows for Vicuna heads; the numbers are
# only a starting point, since the tree built from them is fixed: train_medusa.py writes measured ones.
_PRIOR_TOP1, _PRIOR_DECAY = 0.6, 0.75


class ResBlock(nn.Module):
    """x + SiLU(W x + b) (Medusa's ResBlock; W is zero-initialised, so a fresh head = the LM head)."""

    def __init__(self, hidden_size: int, bias: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """H heads: ``heads.{i}`` = num_layers ResBlocks [+ the LM head as ``heads.{i}.{num_layers}`` in the
    checkpoint, kept here as ``lm_heads.{i}``]; ``token_map`` [Vd] = target id of each draft id."""

    def __init__(self, cfg: MedusaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        D = cfg.hidden_size
        self.heads = nn.ModuleList(nn.Sequential(*[ResBlock(D, cfg.bias) for _ in range(cfg.num_layers)])
                                   for _ in range(cfg.num_heads))
        n_lm = 0 if not cfg.own_lm_head else (1 if cfg.shared_lm_head else cfg.num_heads)
        self.lm_heads = nn.ModuleList(nn.Linear(D, cfg.lm_rows, bias=False) for _ in range(n_lm))
        if cfg.draft_vocab_size:  # [Vd] target id of each draft id
            self.register_buffer("token_map", torch.arange(cfg.draft_vocab_size))
        else:
            self.token_map: torch.Tensor | None = None

    def features(self, h: torch.Tensor, n: int | None = None) -> torch.Tensor:
        """[N, D] target hidden states -> [n, N, D] the first n heads' ResBlock outputs."""
        return torch.stack([blk(h) for blk in self.heads[: n or len(self.heads)]])

    def logits(self, h: torch.Tensor, n: int | None = None,
               target_lm: torch.Tensor | None = None,  # [Vd, D] the target's LM head rows (no own LM head)
               ) -> torch.Tensor:  # [n, N, Vd] float32 over the draft vocabulary (token_map, or all V)
        x = self.features(h, n)
        if not self.lm_heads:
            if target_lm is None:
                raise ValueError("MedusaHeads.logits: these heads use the target's LM head; pass target_lm")
            return (x @ target_lm.T).float()
        return torch.stack([self.lm_heads[0 if len(self.lm_heads) == 1 else i](x[i]) for i in range(len(x))]).float()


def random_medusa(cfg: MedusaConfig, seed: int = 0, scale: float = 1.0) -> MedusaHeads:
    """Seeded random heads (weights ~ scale / sqrt(D)), for tests and debug runs."""
    g = torch.Generator().manual_seed(seed)
    heads = MedusaHeads(cfg)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[-1] ** 0.5)
    return heads.eval()


def load_medusa(path: str | Path) -> MedusaHeads:
    """Medusa heads from a published layout (float32, eval mode)."""
    cfg, sd, _ = read_medusa(path)
    heads = MedusaHeads(cfg)
    heads.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in sd.items()}, strict=True)
    return heads.eval()


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


def sample_from(logits: torch.Tensor, st: SamplingTensors, gens: list[torch.Generator | None],
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, V] logits -> (tokens [B] int64, q [B, V] float32 or None when every row is greedy). Random
    rows draw from q (the request's processed distribution) by the exponential race, with their generator."""
    logits = logits.float()
    if st.all_greedy:
        return logits.argmax(-1), None
    q = st.to_probs(logits)  # greedy rows: one-hot at the argmax
    noise = draw_exponential(logits.shape[0], logits.shape[1], gens, device=logits.device)
    return (q / noise).argmax(-1), q


def last_rows(batch: ProposeBatch, width: int, who: str) -> tuple[torch.Tensor | None, dict[int, int]]:
    """(the threaded hidden states [R, D], seq_id -> its *last* row: the state that produced the pending
    token). Refuses rows of the wrong width (e.g. an EAGLE-3 tap threading fused layers)."""
    hs = batch.hidden_states
    if hs is None:
        return None, {}
    if hs.hidden_states.shape[-1] != width:
        raise ValueError(f"{who}: the threaded hidden states are {hs.hidden_states.shape[-1]} wide but the head "
                         f"takes the target's last layer ({width}); another proposer on this engine changed them")
    return hs.hidden_states, {s: r for r, s in enumerate(hs.seq_ids)}


class MedusaProposer(TreeProposer):
    """Medusa heads as a chain proposer and a static-tree :class:`TreeProposer` (module docstring)."""

    needs_hidden_states = True

    def __init__(self, target: ModelEngine, config) -> None:
        super().__init__(target, config)
        opts = config.options
        heads = opts.get("head_module")
        self.head_name = "<in-process heads>"
        if heads is None:
            path = opts.get("head") or config.model or DEFAULT_HEAD
            self.head_name = str(path)
            heads = self._load(path, opts)
        self.heads: MedusaHeads = heads
        c = heads.cfg
        check_medusa_fits(c, target.hidden_size, target.vocab_size, self.head_name)
        need = (config.tree_depth or config.num_speculative_tokens) if config.scorer == "tree" \
            else config.num_speculative_tokens
        if need > c.num_heads:
            what = "tree_depth" if config.scorer == "tree" else "num_speculative_tokens"
            raise ValueError(f"MedusaProposer: {what}={need} but head {self.head_name} has num_heads={c.num_heads}; "
                             f"Medusa drafts at most one token per head: use {what} <= {c.num_heads}")
        self.heads.to(device=target.device, dtype=target.dtype).eval()
        tm = heads.token_map
        self.token_map = None if tm is None else tm.to(target.device)  # [Vd] draft id -> target id
        self.target_lm = None if heads.lm_heads else self._target_lm_rows(self.token_map)
        self.choices = opts.get("medusa_choices")
        self._trees: dict[TreeShape, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _load(self, path, opts) -> MedusaHeads:
        if str(path) == "tiny-random-llama":  # debug runs: random heads shaped like the target
            cfg = self.config
            n = opts.get("num_heads") or max(cfg.num_speculative_tokens, cfg.tree_depth or 0)
            return random_medusa(MedusaConfig(num_heads=n, hidden_size=self.target.hidden_size,
                                              vocab_size=self.target.vocab_size, own_lm_head=False),
                                 seed=opts.get("seed", 0))
        p = Path(path).expanduser()
        if not p.exists() and not p.is_absolute() and (REPO / p).exists():
            p = REPO / p
        if not p.exists():
            raise FileNotFoundError(f"MedusaProposer: no Medusa head at {str(path)!r}; train one with "
                                    "experiments/train_medusa.py --export <dir>, or give model=tiny-random-llama")
        return load_medusa(p)

    def _target_lm_rows(self, ids: torch.Tensor | None) -> torch.Tensor:
        """The target's LM head weight [V, D] (rows ``ids`` only, if given), through the engine's interface:
        compute_logits of the unit vectors e_d is column d of the weight."""
        eye = torch.eye(self.target.hidden_size, dtype=self.target.dtype, device=self.target.device)
        w = self.target.compute_logits(eye).T  # [V, D]
        return (w if ids is None else w[ids]).to(self.target.dtype).contiguous()

    # ------------------------------------------------------------------ drafting
    def draft_logits(self, h: torch.Tensor, n: int) -> torch.Tensor:
        """[b, D] -> [n, b, Vd] float32 logits of the first n heads over the draft vocabulary."""
        with torch.inference_mode():
            return self.heads.logits(h.to(self.target.dtype), n, self.target_lm)

    def _to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.token_map is None else self.token_map[ids]

    def _active(self, batch: ProposeBatch) -> tuple[list[int], torch.Tensor | None]:
        feats, row_of = last_rows(batch, self.heads.cfg.hidden_size, type(self).__name__)
        act = [b for b, s in enumerate(batch.seq_ids) if s in row_of]  # no row: nothing to draft from
        if not act:
            return act, None
        rows = torch.tensor([row_of[batch.seq_ids[b]] for b in act], device=feats.device)
        return act, feats.index_select(0, rows).to(self.target.device)

    def propose(self, batch: ProposeBatch) -> DraftOutput:
        B, k = len(batch.seq_ids), batch.k
        token_ids = torch.full((B, k), -1, dtype=torch.long)
        lens = torch.zeros(B, dtype=torch.long)
        act, h = self._active(batch)
        if not act:
            return DraftOutput(token_ids=token_ids, probs=None, lens=lens)
        logits = self.draft_logits(h, k)  # [k, b, Vd]
        params = [batch.sampling_params[b] or _GREEDY for b in act]
        st = SamplingTensors.from_params(params, device=logits.device)
        gens = [None if p.temperature == 0 else batch.generators[b] for p, b in zip(params, act)]
        toks, qs = zip(*(sample_from(logits[j], st, gens) for j in range(k)))
        sel = torch.tensor(act)
        token_ids[sel] = self._to_target(torch.stack(toks, 1)).cpu()  # [b, k]
        lens[sel] = k
        probs = None
        if not st.all_greedy:
            q = torch.stack(qs, 1)  # [b, k, Vd]
            if self.token_map is not None:  # the draft vocabulary's q inside the target's
                q = q.new_zeros(*q.shape[:2], self.target.vocab_size).index_copy_(2, self.token_map, q)
            probs = torch.zeros(B, k, q.shape[-1])
            probs[sel] = q.cpu()  # rows without a proposal keep q = 0; Top1Proposer masks them by lens
        return DraftOutput(token_ids=token_ids, probs=probs, lens=lens)

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
        tokens = torch.full((B, N), -1, dtype=torch.long)
        num_nodes = torch.zeros(B, dtype=torch.long)
        act, h = self._active(batch)
        if act:
            logits = self.draft_logits(h, int(head.max()) + 1)  # [n, b, Vd]
            top = logits.topk(int(rank.max()) + 1, dim=-1).indices  # [n, b, R]
            picked = self._to_target(top[head.to(top.device), :, rank.to(top.device)])  # [N, b]
            sel = torch.tensor(act)
            tokens[sel] = picked.T.cpu()
            num_nodes[sel] = N
        return TreeProposals(token_ids=tokens, parents=parents.expand(B, N).clone(), num_nodes=num_nodes)

    def tree_lookahead(self, shape: TreeShape) -> int:
        return 0  # no cache of its own
