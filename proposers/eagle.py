"""EagleProposer: an EAGLE-1 head drafts a chain, or an EAGLE-2 dynamic tree, from the target's features.

The head (``specdec/heads/eagle.py``) keeps one KV slot per sequence, holding *pairs*: the pair of token i
is (the target's feature of token i-1, the embedding of token i), at RoPE position i-1. The features come
from the worker only (``FeatureSpec(history=None)``): every committed token's state since the proposer
last read (a prefill: the whole prompt; a step: the pending token and the accepted drafts), which is what
the EAGLE paper feeds. Before drafting, the proposer feeds the pairs of those rows in one head forward
batched across sequences, whose last output gives d1; then k-1 single-pair forwards feed (own output,
d_j) and give d2..dk. dk is never fed. :meth:`verified` cuts the slot back to pairs of committed tokens;
the next catch-up replaces the accepted drafts' pairs (keyed from the head's own outputs) with the
target's features. Tokens without features are skipped: a slot may have holes (RoPE keeps relative
positions right).

Sampling: greedy rows take the argmax; the others sample from q (the request's processed distribution
over the draft vocabulary, ``specdec.spec_decode.draft_sampling``) and return q, exactly what each draft
was drawn from. Knows nothing about verification or the target's KV cache.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from specdec_kernels import get_ops
from proposers.dynamic_tree import best_first, best_first_rows, build_ranked_tree, head_expand
from proposers.ngram_branch import graft_rows_within_budget, lead_rows, make_branch, stack_rows
from specdec.engine import ModelEngine
from specdec.engine.cpu.ops import native_linears
from specdec.heads import load_head
from specdec.heads.common import CHECKPOINTS, LMHeadRows, load_head_module
from specdec.heads.draft_call import NativeDraftTree
from specdec.heads.eagle import PairSlots, check_eagle_fits, head_pack_dtype, random_head
from specdec.heads.eagle3 import DraftVocab
from specdec.sampling.sampler import SamplingTensors
from specdec.datamodel.sampling_params import SamplingParams
from specdec.spec_decode.config import parse_speculative_config
from specdec.spec_decode.draft_sampling import greedy_free, sample_draft
from specdec.spec_decode.proposer import DraftOutput, FeatureSpec, ProposeBatch
from specdec.spec_decode.proposer import TreeProposals, TreeProposer, TreeShape

log = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0)


def check_ngram_branch(name: str, config) -> int:
    """``options.ngram_branch`` = m of a SpeculativeConfig, checked against the tree it grafts onto -> m (0 = off)."""
    from specdec.spec_decode.registry import resolve

    m, depth = config.options.get("ngram_branch", 0), config.tree_depth or config.num_speculative_tokens
    if isinstance(m, bool) or not isinstance(m, int) or m < 0:
        raise ValueError(f"{name}: options.ngram_branch={m!r} must be an int >= 0 (0 = off; m = graft a "
                         "prompt-lookup draft of up to m tokens onto the head's tree)")
    if m and not resolve("scorer", config.scorer).drafts_trees:
        raise ValueError(f"{name}: options.ngram_branch={m} grafts a branch onto a token tree but scorer="
                         f"{config.scorer!r} scores chains; use scorer=tree (or drop the option)")
    make_branch(config.options.get("branch", "ngram"), name, config)  # a misspelt branch fails here
    if m and not m < config.tree_budget:
        raise ValueError(f"{name}: options.ngram_branch={m} needs m < tree_budget={config.tree_budget} (the branch "
                         "takes up to m of the budget's nodes); lower ngram_branch or raise tree_budget")
    return m


class EagleProposer(TreeProposer):
    """EAGLE-1. speculative_config: ``model`` or ``options.head`` = the head directory (default
    ``checkpoints/smollm2-135m-instruct-eagle``; ``tiny-random-llama`` = a seeded random head shaped like
    the target); ``options.head_module`` = an in-process head (tests); ``options.draft_vocab_size`` = N:
    score only the head's N most frequent training tokens (needs ``draft_vocab.safetensors`` beside it);
    ``options.head_dtype`` = float32 | bfloat16 | auto: the dtype its projections are packed in for the CPU
    kernels (auto: bfloat16 on the AVX2 and AVX512_BF16 kernels); ``options.head_native`` (default true): the head's
    decoder layer in one call of the CPU kernels (``specdec/heads/native.py``; false = torch ops, the reference);
    ``options.ngram_branch`` = m (scorer=tree only): a prompt-lookup draft of up to m tokens
    (``prompt_lookup_min`` / ``prompt_lookup_max``) is grafted on as one more path, and the head's tree gives up
    its worst-ranked nodes to make room (proposers/ngram_branch.py); ``options.branch`` = ngram (default) | suffix:
    which drafter makes that path (suffix: suffix decoding's most frequent continuation, proposers/suffix.py);
    ``options.tree_native`` (default true, scorer=tree): the whole dynamic tree of a step (every depth) in one call of
    the CPU kernels (``specdec/heads/draft_call.py``) where the head's layer is native; false = the re-feeding
    expansion (``build_ranked_tree`` + ``head_expand``), one head call per depth. Drafts only change q, never the
    output's law."""

    option_keys = frozenset({"head", "head_module", "seed", "draft_vocab_size", "head_dtype", "head_native",
                             "tree_native", "ngram_branch", "branch", "features"})  # read from config.options

    method = "eagle"
    default_head = CHECKPOINTS / "smollm2-135m-instruct-eagle"

    def __init__(self, target: ModelEngine, config) -> None:
        super().__init__(target, config)
        opts = config.options
        if "features" in opts:
            raise ValueError(f"{type(self).__name__}: options.features is gone: the worker now threads the target's "
                             "features of every committed token (the former 'exact'); drop the option")
        head = opts.get("head_module")
        self.head_name = "<in-process head>"
        if head is None:
            path = opts.get("head") or config.model or self.default_head
            self.head_name = str(path)
            head = load_head_module(path, type(self).__name__, lambda p: load_head(p, method=self.method),
                                    lambda: self._random(opts.get("seed", 0)),
                                    f"train one with python -m experiments.train.{self.method} ... export=<dir>")
        self.head = head
        self.features = FeatureSpec(layers=self.target_layers(), history=None)
        self._check_fits()
        # the head computes in the target's activation dtype: fp32 on the CPU kernels even with bf16 weights (a bf16
        # head cache kept the head off its native layer and the one-call tree: 5.4 ms per step instead of ~1)
        self.act_dtype = target.activation_dtype
        self.head.to(device=target.device, dtype=self.act_dtype).eval()
        self.pack_dtype = head_pack_dtype(opts.get("head_dtype", "auto"))
        native_linears(self.head, self.pack_dtype)  # the head's projections through the CPU kernels
        self.head.init_cache(target.num_slots, target.max_model_len, self.act_dtype, target.device)
        # the decoder layer in one native call (heads/native.py) unless options.head_native=false or it cannot
        self.head_kernel = "torch (options.head_native=false)"
        if opts.get("head_native", True):
            why = self.head.use_native(self.pack_dtype) if target.device.type == "cpu" else f"device {target.device}"
            self.head_kernel = "native" if why is None else f"torch ({why})"
        self._setup_vocab(opts)
        self.tree_call, self.tree_kernel = self._tree_call(opts.get("tree_native", True))
        log.info("%s: head layer %s, tree %s, activations %s, projections packed %s", type(self).__name__,
                 self.head_kernel, self.tree_kernel, str(self.act_dtype).removeprefix("torch."),
                 str(self.pack_dtype).removeprefix("torch."))
        self._ops = get_ops(config.kernel)
        self.pairs = PairSlots(self.head.cache)  # which pairs each sequence's head slot holds
        self.ngram_branch = check_ngram_branch(type(self).__name__, config)
        self.branch = make_branch(opts.get("branch", "ngram"), type(self).__name__, config)

    @classmethod
    def check_config(cls, spec) -> None:
        check_ngram_branch(cls.__name__, parse_speculative_config(spec))

    @classmethod
    def config_keys(cls, spec):
        """The head's checkpoint (options.head first); prompt lookup's n only with a grafted n-gram branch."""
        opts = spec.get("options") or {}
        lookup = opts.get("ngram_branch") and opts.get("branch", "ngram") == "ngram"
        return frozenset({"model", "prompt_lookup_max", "prompt_lookup_min"} if lookup else {"model"})

    def _random(self, seed: int):
        cfg = getattr(self.target, "config", None)
        if cfg is None:
            raise ValueError(f"{type(self).__name__}: a random head needs the target's ModelConfig (target.config); "
                             f"{type(self.target).__name__} has none")
        return random_head(cfg, self.method, seed)

    def target_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs the head reads; () = the last layer after the final norm."""
        return ()

    def _check_fits(self) -> None:
        check_eagle_fits(self.head.cfg, self.target.hidden_size, self.target.vocab_size, self.method, self.head_name)

    def _setup_vocab(self, opts) -> None:
        """EAGLE-1 scores the target's LM head; ``draft_vocab_size`` = N restricts it to the head's N most
        frequent training tokens."""
        n, ids = opts.get("draft_vocab_size"), None
        if n:
            ids = getattr(self.head, "freq_ids", None)
            if ids is None:
                raise ValueError(f"{type(self).__name__}: options.draft_vocab_size={n} needs the head's token "
                                 f"frequencies (draft_vocab.safetensors beside {self.head_name})")
            ids = ids[:n].sort().values.to(self.target.device)
        self.lm = LMHeadRows(self.target, ids, self.pack_dtype)  # the draft vocabulary: .logits(out), .ids (draft -> target), .size

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The target's embedding of ``token_ids`` [n] -> [n, D] in the head's activation dtype."""
        return self.target.embed(token_ids).to(self.act_dtype)

    def _tree_call(self, want: bool) -> tuple[NativeDraftTree | None, str]:
        """(the one-call tree drafter, or None; which path the tree takes, in words)."""
        if not want:
            return None, "python (options.tree_native=false)"
        if self.head.native is None:
            return None, f"python (the head's layer runs {self.head_kernel})"
        lm = None if isinstance(self.lm, DraftVocab) else self.lm._native  # EAGLE-1: the target's LM head rows
        if lm is None and not isinstance(self.lm, DraftVocab):
            return None, "python (the LM head rows are not packed)"
        ids = self.lm.ids if self.lm.ids is not None else torch.arange(self.target.vocab_size, device=self.target.device)
        emb = self.target.embed(ids)  # [Vd, D]: the target's embedding of each draft id
        if lm is not None and emb.dtype == self.lm.weight.dtype and torch.equal(emb, self.lm.weight):
            emb = self.lm.weight  # tied (SmolLM2): the rows LMHeadRows holds anyway, no second copy
        try:
            return NativeDraftTree(self.head, emb, lm), "native"
        except (RuntimeError, ValueError) as e:
            return None, f"python ({e})"

    # ------------------------------------------------------------------ state (PairSlots)
    def verified(self, seq_id: int, num_valid_tokens: int) -> None:
        self.pairs.verified(seq_id, num_valid_tokens)

    def free(self, seq_id: int) -> None:
        self.pairs.free(seq_id)
        self.branch.free(seq_id)

    def snapshot(self, seq_ids: list[int]) -> dict[int, int | None]:
        """A step only cuts back and appends, and the rows it re-feeds are restored with the worker's
        HiddenStates, so restoring the pair counts makes a re-run feed the same pairs."""
        return self.pairs.snapshot(seq_ids)

    def restore(self, seq_ids: list[int], snapshot: dict[int, int | None]) -> None:
        self.pairs.restore(snapshot)

    # ------------------------------------------------------------------ drafting
    def _catch_up_rows(self, batch: ProposeBatch) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int], list[int]]:
        """The pairs of every threaded row, recorded in ``self.pairs`` (re-fed rows replace the pairs they cover)
        -> (embeddings [R, D], features [R, F], positions [R], rows per sequence [B], head slots [B])."""
        dev = self.target.device
        toks, fts, pos, qlens, slots = [], [], [], [], []
        for s, tokens, rows in zip(batch.seq_ids, batch.token_ids, batch.feature_rows()):
            slots.append(self.pairs.slot(s))
            first = len(tokens) - rows.shape[0]  # token index of the first row's pair
            self.pairs.keep_before(s, first, tokens)  # re-fed rows replace the pairs they cover
            for i in range(first, len(tokens)):
                self.pairs.add(s, i, tokens[i])
                toks.append(tokens[i])
                pos.append(i - 1)
            fts.append(rows)
            qlens.append(len(tokens) - first)
        emb = self._embed(torch.tensor(toks, dtype=torch.long, device=dev))
        feats = torch.cat(fts).to(dev, emb.dtype)
        if feats.shape[-1] != self.head.cfg.feature_size:
            raise ValueError(f"{type(self).__name__}: the threaded features are {feats.shape[-1]} wide but head "
                             f"{self.head_name} takes {self.head.cfg.feature_size} (target layers {self.features.layers})")
        return emb, feats, pos, qlens, slots

    def _catch_up(self, batch: ProposeBatch):
        """Feed the pairs of every threaded row, one head forward for all sequences. -> (last [B, D] head output
        at each pending token, its draft logits [B, Vd], head slots, the pending pairs' positions)."""
        dev = self.target.device
        emb, feats, pos, qlens, slots = self._catch_up_rows(batch)
        ends = np.cumsum(qlens) - 1
        out, logits = self.head.forward_logits(emb, feats, torch.tensor(pos, device=dev), slots, qlens, ends.tolist(),
                                               self.lm.logits)
        last_pos = [len(t) - 2 for t in batch.token_ids]
        return out[torch.from_numpy(ends).to(dev)], logits, slots, last_pos

    def propose(self, batch: ProposeBatch) -> DraftOutput:
        dev = self.target.device
        last, logits, slots, last_pos = self._catch_up(batch)
        params = [p or _GREEDY for p in batch.sampling_params]
        st = SamplingTensors.from_params(params, device=dev)
        gens = greedy_free(params, batch.generators)
        d2t = self.lm.ids
        drafts, probs = [], []
        positions = torch.tensor(last_pos, device=dev)
        for j in range(batch.k):
            d, q = sample_draft(logits, st, gens, self.config.kernel)  # draft ids [B], q [B, Vd]
            tok = d if d2t is None else d2t[d]
            drafts.append(tok)
            probs.append(q)
            if j == batch.k - 1:
                break  # dk is never fed: the next step's rows cover it
            positions = positions + 1
            last, logits = self.head.forward_logits(self._embed(tok), last, positions, slots, [1] * len(slots),
                                                    list(range(len(slots))), self.lm.logits)
            for s, tokens, t in zip(batch.seq_ids, batch.token_ids, tok.tolist()):
                self.pairs.add(s, len(tokens) + j, t)
        q = None
        if not st.all_greedy:
            q = torch.stack(probs, 1)  # [B, k, Vd]
            if d2t is not None:  # the draft vocabulary's q inside the target's
                q = torch.zeros(*q.shape[:2], self.target.vocab_size, device=q.device).index_copy_(2, d2t, q)
        return DraftOutput(token_ids=torch.stack(drafts, 1), probs=q)

    # ------------------------------------------------------------------ EAGLE-2 dynamic tree
    def tree_max_path(self, shape: TreeShape) -> int:
        return max(shape.depth, self.ngram_branch)  # the grafted n-gram path may reach past the head's depth

    def tree_lookahead(self, shape: TreeShape) -> int:
        return max(shape.budget, (shape.depth - 1) * shape.topk)  # the last re-feed holds (depth-1)*k pairs

    def propose_tree(self, batch: ProposeBatch, shape: TreeShape) -> TreeProposals:
        """EAGLE-2: the catch-up the chain does and every depth of the tree in one native call
        (``specdec/heads/draft_call.py``: each frontier fed once, the slots left at their committed length), or,
        where it cannot run or ``options.tree_native=false``, :func:`build_dynamic_tree` with the head as ``expand``
        (:func:`head_expand`, re-feeding every frontier so far per depth) and a cut back to the committed pairs. The
        same tree either way (tests/heads/test_draft_call.py); the next step's rows re-feed the accepted path with
        the target's features. The nodes come best first (:func:`best_first`, by draft log-probability: a
        policy's smaller budget keeps the best ones). With ``ngram_branch`` = m a prompt-lookup draft is grafted on
        and the head's tree drops the worst-ranked nodes the budget cannot hold beside it
        (:func:`graft_within_budget`)."""
        m = self.ngram_branch
        if self.tree_call is not None:  # the catch-up and every depth in one call; the slots end at the committed pairs
            t = self.tree_call(*self._catch_up_rows(batch), shape, self.lm.ids)
            if not m:
                return best_first(TreeProposals(t.tokens, t.parents, t.num_nodes), t.rank)[0]
            counts = t.num_nodes.tolist()  # lists from the call to the grafted rows: one tensor each at the end
            toks, pars, ranks = best_first_rows(t.tokens.tolist(), t.parents.tolist(), counts, t.rank.tolist())
            return self._grafted(batch, m, shape.budget, toks, pars, counts, ranks, t.tokens.device)
        last, logits, slots, last_pos = self._catch_up(batch)
        committed = [len(self.pairs.idx[s]) for s in batch.seq_ids]
        d2t = self.lm.ids
        expand = head_expand(self.head, self._embed, self.lm.logits, self._ops.build_tree_mask, last, slots,
                             committed, torch.tensor(last_pos, device=last.device), d2t, self.lm.size, shape)
        tree, _, rank = build_ranked_tree(torch.log_softmax(logits, -1), expand, shape)
        for slot, n in zip(slots, committed):
            self.head.cache.rollback(slot, n)
        ids = tree.token_ids if d2t is None else d2t[tree.token_ids]
        out, rank = best_first(TreeProposals(ids, tree.parents, tree.num_nodes), rank)
        if m:
            return self._grafted(batch, m, shape.budget, out.token_ids.tolist(), out.parents.tolist(),
                                 out.num_nodes.tolist(), rank.tolist(), out.token_ids.device)
        return out

    def _grafted(self, batch: ProposeBatch, m: int, budget: int, toks: list[list[int]], pars: list[list[int]],
                 counts: list[int], ranks: list[list[int]], dev) -> TreeProposals:
        """The head's best-first trees (lists, [B][N]) with the branch's paths grafted on within ``budget`` and, where
        a path leads, put first (proposers/ngram_branch.py)."""
        chains, lead = self.branch.chains(batch, m)
        rows = graft_rows_within_budget(toks, pars, counts, ranks, chains, budget)
        return stack_rows(lead_rows(rows, chains, lead), 0, dev)
