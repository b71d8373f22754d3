"""TreeSpecDecodeWorker: one tree-speculation step (EAGLE-2 style), selected by ``scorer="tree"``.

Data flow of a step (everything else, prefill, plain steps and HiddenStates pruning, is
SpecDecodeWorker's, reused unchanged):

  TreeTop1Proposer.get_spec_proposals  -> TreeProposals [B, N] (rows that cannot fit a tree get 0 nodes)
  TreeScorer.score_proposals           -> TreeScores: one target forward over [pending, nodes] per
                                          sequence with the tree mask and depth positions
  TreeVerifier.verify                  -> accepted root-to-node path + one final token per sequence
  _verify (here)                       -> target.compact(slot, cache indices of the path, base_len): the
                                          accepted nodes' KV moves into place, the rest is dropped;
                                          proposer.verified_tree(seq_id, base_len, path, path hidden);
                                          HiddenStates = the target's state at the last accepted node
                                          (second-last: the node before it).

Conventions: ``num_proposed`` = tree nodes scored, ``num_accepted`` = path length (<= depth, so
``spec_token_acceptance_counts`` has depth + 1 entries and counts accepted *depths*). A sequence is in
``seq_ids_with_bonus`` when its accepted path ends at a leaf of the tree (the final token is the
target's bonus after a draft the proposer produced but may never have run).
Knows nothing about how trees are drafted.
"""

from __future__ import annotations

import logging

import torch

from scorers.tree import TreeScorer, TreeScores
from specdec.engine import ModelEngine
from specdec.interfaces import GroupStepOutput, StepOutput
from specdec.sequence import ExecuteModelRequest, HiddenStates, Logprob
from specdec.spec_decode.top1_proposer import Top1Proposer
from specdec.spec_decode.worker import SpecDecodeWorker
from specdec.tree import TreeProposals, TreeProposer, TreeShape, TreeVerifier
from specdec.sampling import Sampler
from specdec.worker import PlainWorker, nan_error

log = logging.getLogger(__name__)


class TreeTop1Proposer(Top1Proposer):
    """Top1Proposer's edge cases for trees: a row speculates unless the batch is at
    ``disable_by_batch_size`` or its tree would not fit in max_model_len (target: budget positions
    after the committed tokens; the proposer's own cache: ``tree_lookahead``)."""

    def __init__(self, proposer: TreeProposer, shape: TreeShape, max_model_len: int, vocab_size: int,
                 disable_by_batch_size: int | None = None) -> None:
        super().__init__(proposer, shape.depth, max_model_len, vocab_size, disable_by_batch_size)
        self.shape = shape
        self.need = max(shape.budget, proposer.tree_lookahead(shape))

    def seq_ks(self, req: ExecuteModelRequest) -> list[int]:
        if self.disable_by_batch_size is not None and req.running_queue_size >= self.disable_by_batch_size:
            return [0] * len(req.seq_group_metadata_list)
        return [self.k if next(iter(m.seq_data.values())).get_len() + self.need <= self.max_model_len else 0
                for m in req.seq_group_metadata_list]

    def get_spec_proposals(self, execute_model_req: ExecuteModelRequest,  # type: ignore[override]
                           seq_ids_with_bonus_token_in_last_step: set[int]) -> TreeProposals:
        metas = execute_model_req.seq_group_metadata_list
        rows = [i for i, k in enumerate(self.seq_ks(execute_model_req)) if k > 0]
        if not rows:
            return TreeProposals.empty(len(metas))
        out = self.proposer.propose_tree(self._batch(metas, rows, seq_ids_with_bonus_token_in_last_step),
                                         self.shape)
        if out.token_ids.shape[0] != len(rows) or out.token_ids.shape[1] > self.shape.budget:
            raise ValueError(f"{type(self.proposer).__name__}.propose_tree returned {tuple(out.token_ids.shape)} "
                             f"nodes for {len(rows)} sequences; expected [{len(rows)}, <= budget="
                             f"{self.shape.budget}]")
        return out.scatter_rows(rows, len(metas))


class TreeSpecDecodeWorker(SpecDecodeWorker):
    """SpecDecodeWorker with a tree proposer, the tree scorer and the tree verifier (module docstring)."""

    def _verify(self, metas, proposals: TreeProposals, scores: TreeScores) -> StepOutput:  # type: ignore[override]
        logits = scores.logits  # [B, M, V]
        # a row whose logits are not finite must not poison the others; NaN/inf propagate through the sum
        bad = ~torch.isfinite(logits.sum(-1)).all(-1)  # [B]
        if bad.any():
            logits = torch.where(bad[:, None, None], torch.zeros_like(logits), logits)
        seq_ids, datas = zip(*(next(iter(m.seq_data.items())) for m in metas))
        parents, tokens = proposals.with_root(torch.tensor([d.get_last_token_id() for d in datas]))  # [B, M]
        params = [m.sampling_params for m in metas]
        gens = [m.state.generator if m.state is not None else None for m in metas]
        path, out = self.verifier.verify(logits, parents.to(logits.device), tokens.to(logits.device),
                                         proposals.draft_probs_with_root(), params, gens,
                                         noise_width=self.top1.shape.budget + 1)
        path, out = path.cpu(), out.cpu()  # [B, M] root-inclusive accepted nodes / emitted tokens, -1 padded
        n_acc = (path >= 0).sum(1) - 1  # [B] accepted drafts
        lps = chosen_logprobs(logits, path, out, n_acc)
        leaf = ends_at_leaf(parents, path, n_acc).tolist()
        hidden = scores.hidden_states  # [B, M, D]
        results = []
        self.seq_ids_with_bonus = set()
        for b, (meta, seq_id, data) in enumerate(zip(metas, seq_ids, datas)):
            a, base = int(n_acc[b]), data.get_len()  # the target held base-1 tokens; the pending one is next
            nodes = path[b, 1 : a + 1]  # root-inclusive; ascending, since a parent's index is below its child's
            # node i sits at cache index base-1+i: move the path to base, base+1, ... and drop the rest
            self.target.compact(self.plain.slots.slot_of[seq_id], nodes + (base - 1), base)
            self.top1.proposer.verified_tree(seq_id, base, (nodes - 1).tolist(), hidden[b, path[b, : a + 1]])
            if bool(bad[b]):
                results.append(GroupStepOutput([], error=nan_error(meta.request_id)))
                continue
            toks = out[b, : a + 1].tolist()
            results.append(GroupStepOutput(toks, [{t: Logprob(logprob=lp, rank=None)} for t, lp in zip(toks, lps[b])],
                                           num_proposed=int(proposals.num_nodes[b]), num_accepted=a))
            if a > 0 and leaf[b]:
                self.seq_ids_with_bonus.add(seq_id)
        rows = torch.arange(len(metas))
        last = path[rows, n_acc]  # [B] deepest accepted node (0 = the pending token)
        second = path[rows, (n_acc - 1).clamp(min=0)]
        self.hidden_states = HiddenStates(
            hidden_states=hidden[rows, last],
            seq_group_metadata_list=metas,
            second_last_token_hidden_states=hidden[rows, second],
        )
        return StepOutput(results)


def chosen_logprobs(logits: torch.Tensor,  # [B, M, V] raw target logits
                    path: torch.Tensor,  # [B, M] int64 accepted nodes, -1 padded
                    out: torch.Tensor,  # [B, M] int64 emitted tokens, -1 padded
                    n_acc: torch.Tensor,  # [B] int64
                    ) -> list[list[float]]:  # per row: log_softmax(raw logits)[emitted token], n_acc+1 values
    """Computed on the emitted rows only (<= depth+1 per sequence), not on all B * M rows."""
    counts = (n_acc + 1).tolist()
    b = torch.repeat_interleave(torch.arange(len(counts)), n_acc + 1)  # [E]
    j = torch.cat([torch.arange(c) for c in counts])  # [E]
    rows = logits[b, path[b, j]]  # [E, V]
    lp = rows.gather(1, out[b, j][:, None].to(rows.device))[:, 0] - torch.logsumexp(rows, -1)
    return [x.tolist() for x in lp.cpu().split(counts)]


def ends_at_leaf(parents: torch.Tensor,  # [B, M] int64 root-inclusive
                 path: torch.Tensor, n_acc: torch.Tensor) -> torch.Tensor:  # [B] bool
    """Whether the deepest accepted node has no child in the tree (a bonus token follows a leaf).
    Padding nodes hang off the root, so they never make a real node look like a parent."""
    B, M = parents.shape
    has_child = torch.zeros(B, M + 1, dtype=torch.bool).scatter_(1, parents.cpu() + 1, True)[:, 1:]
    last = path[torch.arange(B), n_acc]
    return (n_acc > 0) & ~has_child[torch.arange(B), last]


def build_tree_worker(target: ModelEngine, cfg, proposer_cls: type, *, max_model_len: int,
                      ) -> tuple[TreeSpecDecodeWorker, int]:
    """(worker, depth) for ``scorer="tree"``; refuses chain-only proposers (config refuses lossy acceptance)."""
    if not (isinstance(proposer_cls, type) and issubclass(proposer_cls, TreeProposer)):
        raise ValueError(f"scorer=tree needs a tree-capable proposer; {cfg.method} is chain-only "
                         f"({proposer_cls.__module__}.{proposer_cls.__qualname__} does not subclass "
                         "specdec.tree.TreeProposer). Use scorer='mqa', or a tree proposer such as "
                         "'proposers.tree_draft:TreeDraftProposer'")
    shape = TreeShape(depth=cfg.tree_depth or cfg.num_speculative_tokens, topk=cfg.tree_topk,
                      budget=cfg.tree_budget)
    log.info("tree speculation: depth=%d topk=%d budget=%d", shape.depth, shape.topk, shape.budget)
    proposer = proposer_cls(target, cfg)
    plain = PlainWorker(target, Sampler(kernel=cfg.kernel))
    if hasattr(target, "use_kernel"):  # the accepted path's KV compaction runs on the chosen kernel too
        target.use_kernel(cfg.kernel)
    top1 = TreeTop1Proposer(proposer, shape, max_model_len, target.vocab_size, cfg.disable_by_batch_size)
    worker = TreeSpecDecodeWorker(plain, top1, TreeScorer(target, plain.slots.slot_of, cfg.kernel),
                                  TreeVerifier(cfg.kernel))
    return worker, shape.depth
