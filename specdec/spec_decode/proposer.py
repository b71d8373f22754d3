"""The plug-in contract of a draft method. A proposer only makes tokens.

It does not decide k per sequence, pad, scatter rows or handle the batch-size cut-off: Top1Proposer does
that once, and hands it only the rows that can draft. It keeps whatever per-sequence state it likes (a
draft KV slot, an n-gram index), told about committed tokens through :meth:`Proposer.accepted` and about
finished sequences through :meth:`Proposer.free`; a step that fails is undone through
:meth:`Proposer.snapshot` / :meth:`Proposer.restore`.

The target's features reach a proposer one way only: it declares a :class:`FeatureSpec`, the worker asks
the target engine for those layers in every forward (``ForwardBatch.hidden_layers``) and threads the rows
in ``ProposeBatch.hidden_states`` (``ExecuteModelRequest.previous_hidden_states``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from specdec.interfaces import SpeculativeProposals

if TYPE_CHECKING:
    from specdec.engine import ModelEngine
    from specdec.datamodel.sampling_params import SamplingParams
    from specdec.datamodel.hidden_states import HiddenStates
    from specdec.datamodel.sequence import SequenceData
    from specdec.spec_decode.config import SpeculativeConfig


@dataclass(frozen=True)
class FeatureSpec:
    """Which of the target's hidden states a proposer reads, and how many rows per sequence."""

    # target layers whose outputs (residual stream, pre final norm) are concatenated; () = the last layer
    # after the final norm (the LM head's input: EAGLE-1, Medusa, MLP speculator)
    layers: tuple[int, ...] = ()
    # rows kept per sequence: 1 = the state that produced the pending token (Medusa, MLP speculator); None =
    # every committed token's state since the proposer last read, the prompt's included (EAGLE's features)
    history: int | None = 1


class TokenLists(Sequence):
    """[B] each sequence's full tokens as a list, made on first access (ProposeBatch.token_ids from SequenceData: a
    proposer that reads numpy arrays through ProposeBatch.token_arrays never pays for the lists)."""

    def __init__(self, seqs: list["SequenceData"]) -> None:
        self._seqs = seqs
        self._lists: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self._seqs)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self._seqs)))]
        i = range(len(self._seqs))[i]  # negative indices; IndexError past the end
        got = self._lists.get(i)
        if got is None:
            got = self._lists[i] = self._seqs[i].get_token_ids()
        return got

    def __eq__(self, other) -> bool:  # compares as the list of lists it stands for
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass
class ProposeBatch:
    """The sequences to draft for this step (only those with k > 0 and, for a proposer with a FeatureSpec,
    at least one feature row), all drafting the same k."""

    seq_ids: list[int]  # [B]
    token_ids: "Sequence[list[int]]"  # [B] each sequence's full tokens (prompt + output); the last is pending
    k: int  # draft tokens wanted per sequence (a tree: its depth)
    sampling_params: list["SamplingParams"]  # [B] (temperature 0 = greedy: draft greedily too)
    generators: list[torch.Generator | None]  # [B] per-request generators (seeded requests)
    # the target's features (FeatureSpec), rows of a sequence in token order: the last row is the state of
    # the token before the pending one, so row j of a sequence with m rows is the state of token
    # len(tokens) - 1 - m + j. It may hold rows of other sequences too: read it through feature_rows().
    # None for a proposer without a FeatureSpec.
    hidden_states: "HiddenStates | None" = None
    seq_ids_with_bonus_token_in_last_step: frozenset[int] = frozenset()
    # [B] the speculation policy's number per row (draft tokens; a tree: nodes), each <= k (a tree: its budget);
    # None = every row the full k / budget. A proposer may draft less work from it (ngram, suffix do); it need
    # not: Top1Proposer cuts every proposal to it anyway
    row_k: list[int] | None = None
    # [B] the sequences themselves, where the caller has them (Top1Proposer): token_arrays() reads them directly
    sequences: "list[SequenceData] | None" = None

    def token_arrays(self) -> list[np.ndarray]:
        """[B] each sequence's full tokens as a new int64 array [L_b]: read from ``sequences`` when given (no list)."""
        if self.sequences is not None:
            return [d.get_token_array() for d in self.sequences]
        return [np.asarray(t, dtype=np.int64) for t in self.token_ids]

    def feature_rows(self) -> list[torch.Tensor]:
        """[B] each sequence's rows [m_b, F] (m_b >= 1), in batch order."""
        hs = self.hidden_states
        if hs is None:
            raise ValueError("ProposeBatch.feature_rows: no hidden states were threaded; declare a FeatureSpec "
                             "(Proposer.features) to receive them")
        rows: dict[int, list[int]] = {}
        for r, s in enumerate(hs.seq_ids):
            rows.setdefault(s, []).append(r)
        feats = hs.hidden_states
        return [feats[rows[s][0]: rows[s][-1] + 1] for s in self.seq_ids]


@dataclass
class DraftOutput:
    token_ids: torch.Tensor  # [B, k] int64; -1 past a sequence's length
    probs: torch.Tensor | None  # [B, k, V] float32 draft distribution q each token was sampled from;
    #                             None = deterministic drafts (q is one-hot at the token)
    lens: torch.Tensor | None = None  # [B] int64 tokens actually proposed (None = k for all)


PROPOSER_KEYS = ("model", "num_layers", "prompt_lookup_max", "prompt_lookup_min")  # read by some proposers only


class Proposer(ABC):
    """Base class of every draft method. Subclasses that read the target's features set ``features``.

    Options (``speculative_config["options"]``, ``proposer.options.x=1``): each key becomes a keyword argument of
    ``__init__`` when ``__init__`` declares it (``def __init__(self, target, config, nmax=3)``). A proposer that
    reads ``config.options`` itself lists the keys it reads in ``option_keys``. Any other key is refused before
    a model loads (specdec.spec_decode.builder.proposer_kwargs), naming the keys the proposer takes."""

    features: FeatureSpec | None = None
    # True: drafting costs next to nothing and depends on the tokens alone (no model, no randomness): the worker may
    # then ask for drafts it will not verify, to observe their acceptance (shadow drafts, spec_decode/policy.py)
    free_drafts: bool = False
    option_keys: frozenset[str] = frozenset()  # options read from config.options (not __init__ arguments)

    def __init__(self, target: "ModelEngine", config: "SpeculativeConfig") -> None:
        self.target = target
        self.config = config

    @classmethod
    def check_config(cls, spec: dict[str, Any]) -> None:
        """Refuse a speculative_config this proposer cannot run, before any model loads (composition)."""

    @classmethod
    def config_keys(cls, spec: dict[str, Any]) -> frozenset[str] | None:
        """Which of the proposer-specific speculative_config keys (PROPOSER_KEYS) this proposer reads under ``spec``;
        a run that sets another one is refused (it would be recorded and do nothing). None: not declared (a plug-in),
        nothing is checked."""
        return None

    @abstractmethod
    def propose(self, batch: ProposeBatch) -> DraftOutput:
        """Draft ``batch.k`` tokens after each sequence's last (pending) token."""

    def draft_lists(self, batch: ProposeBatch) -> list[list[int]]:
        """[B] what :meth:`propose` drafts for each row (at most ``row_k[b]`` tokens), as lists: a free-draft
        proposer's shadow drafts (spec_decode/policy.py), read without tensors. Default: propose, then read it."""
        out = self.propose(batch)
        k = batch.k
        toks = out.token_ids[:, :k].tolist()
        lens = [k] * len(toks) if out.lens is None else out.lens.tolist()
        row_k = batch.row_k or [k] * len(toks)
        return [[t for t in row[:min(n, kk)] if t >= 0] for row, n, kk in zip(toks, lens, row_k)]

    def draft_classes(self, batch: ProposeBatch) -> list[int] | None:
        """[B] a free-draft proposer's confidence class per row for this step, before drafting (n-gram: the match
        length), 0 = it would draft nothing; the goodput policy keeps its acceptance estimates per class
        (spec_decode/policy.py). None (the default): no classes."""
        return None

    def verified(self, seq_id: int, num_valid_tokens: int) -> None:
        """The first ``num_valid_tokens`` tokens of the sequence are final and equal to what the proposer
        was fed (the prefix plus the accepted drafts); anything it cached past them is stale."""

    def accepted(self, seq_id: int, base_len: int, nodes: list[int]) -> None:
        """The step committed: the sequence's first ``base_len`` tokens (up to the pending one) then the
        tokens of draft nodes ``nodes`` (a root-to-node path, in order; a chain: 0, 1, ..., a-1).
        Default: a proposer that cached node i at position base_len + i keeps the path's prefix that sits
        there (a chain: all of it) through :meth:`verified`."""
        n = 0
        while n < len(nodes) and nodes[n] == n:
            n += 1
        self.verified(seq_id, base_len + n)

    def free(self, seq_id: int) -> None:
        """The sequence finished or was aborted: release its state."""

    def snapshot(self, seq_ids: list[int]) -> Any:
        """Taken before every step: what :meth:`restore` needs to undo the step for these sequences."""
        return None

    def restore(self, seq_ids: list[int], snapshot: Any) -> None:
        """The step raised or was interrupted: put the sequences' state back as :meth:`snapshot` saw it.

        The default frees them: exact for a stateless proposer, and safe for one that (like every
        proposer here) rebuilds its state lazily from the tokens it is given. Override it to restore
        exactly, so that a rolled-back step leaves the next drafts bit-identical."""
        for seq_id in seq_ids:
            self.free(seq_id)


# The tree contract (scorer="tree"). A tree proposal is the one proposal type (specdec.interfaces): a chain
# is a tree whose parents are i-1.
@dataclass(frozen=True)
class TreeShape:
    """EAGLE-2's dynamic-tree knobs (speculative_config tree_depth / tree_topk / tree_budget)."""

    depth: int  # depths the drafter expands (a grafted branch may reach past it: TreeProposer.tree_max_path)
    topk: int  # children expanded per node, and nodes expanded per depth
    budget: int  # draft nodes kept (best cumulative draft log-prob), = target tokens scored - 1

    def __post_init__(self) -> None:
        if min(self.depth, self.topk, self.budget) < 1:
            raise ValueError(f"TreeShape: depth={self.depth}, topk={self.topk}, budget={self.budget} must all "
                             "be >= 1 (speculative_config tree_depth / tree_topk / tree_budget)")


TreeProposals = SpeculativeProposals


class TreeProposer(Proposer):
    """A proposer that can also draft a token tree (``scorer="tree"``). It keeps the chain ``propose``.

    Per step: :meth:`propose_tree`; after verification, :meth:`Proposer.accepted` with the accepted path.
    """

    @abstractmethod
    def propose_tree(self, batch: ProposeBatch, shape: TreeShape) -> TreeProposals:
        """A tree of at most ``shape.budget`` nodes and depth ``shape.depth`` after each sequence's pending
        token; rows in batch order (``num_nodes`` may be 0 for a row it cannot draft)."""

    def tree_max_path(self, shape: TreeShape) -> int:
        """The longest root-to-leaf path its trees of ``shape`` can have = the most drafts one step can accept:
        ``shape.depth``, or more where the proposer grafts a longer path on (EAGLE's ``options.ngram_branch``).
        Sizes the acceptance counters (positions 0..this), so no accepted draft goes uncounted."""
        return shape.depth

    def tree_lookahead(self, shape: TreeShape) -> int:
        """KV positions past a sequence's committed tokens one tree step needs in the proposer's own cache
        (the target needs ``shape.budget``); rows without that much room do not speculate."""
        return shape.budget

