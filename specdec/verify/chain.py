"""Verification of a k-token proposal against the target: which drafts to keep, and the next token.

- :class:`RejectionSampler` — lossless: the emitted tokens are distributed exactly as sampling from the
  target one token at a time (accept x with min(1, p(x)/q(x)); at the first rejection emit the
  **recovered** token ~ norm(max(p - q, 0)); if all k are accepted emit the **bonus** token ~ p_k).
  Temperature-0 rows use exact greedy matching instead.
- :class:`TypicalAcceptanceSampler` — Medusa's typical acceptance; LOSSY (faster, not distributed as p).

Both take the same call as vLLM v0's samplers, ``(target_with_bonus_probs [B,k+1,V], bonus_token_ids
[B,1], draft_probs [B,k,V] | None, draft_token_ids [B,k], seeded_seqs) -> output_token_ids [B,k+1]``,
and a convenience entry :meth:`verify` from target logits + per-request ``SamplingParams``, which is what
the spec-decode worker calls. Output: int64, the emitted tokens then -1; the number of accepted drafts
of a row is ``num_accepted_tokens(out)`` = (non -1 count) - 1.

Conventions the proposers follow:
- ``draft_probs`` is the distribution each draft token was actually drawn from (after the draft's own
  temperature/filters). A proposer without probabilities (n-gram) or a deterministic (greedy) draft
  passes ``None``: q is one-hot at the drafted token (accept with p(x); recover from p with x removed).
- A proposal shorter than k (``proposal_lens[b] < k``) is padded with -1 in ``draft_token_ids``; padded
  positions are rejected and q counts as 0 there, so the token emitted at the first padded position is
  plain sampling from p (greedy rows: the target's argmax). A length-0 proposal is plain decoding.
Ops run through ``specdec_kernels.get_ops(kernel)``; this module holds no tensor maths of its own.
Knows nothing about models, KV caches or request state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from specdec_kernels import get_ops
from specdec_kernels.noise import draw_exponential, draw_uniform
from specdec.interfaces import SpeculativeProposals, SpeculativeVerifier, Verdict
from specdec.sampling.sampler import SamplingTensors, argmax_last
from specdec.datamodel.sampling_params import SamplingParams
from specdec.verify.rows import num_accepted_tokens, split_rows
from specdec.verify.tree import TreeVerifier

__all__ = ["RejectionSampler", "TypicalAcceptanceSampler"]


def _check_shapes(name: str, target: torch.Tensor, draft_token_ids: torch.Tensor,
                  draft_probs: torch.Tensor | None) -> tuple[int, int, int]:
    if target.dim() != 3:
        raise ValueError(f"{name}: target has shape {tuple(target.shape)}, expected [B, k+1, V].")
    B, k1, V = target.shape
    if draft_token_ids.shape != (B, k1 - 1):
        raise ValueError(f"{name}: draft_token_ids has shape {tuple(draft_token_ids.shape)}, expected "
                         f"[{B}, {k1 - 1}] for a target of shape [{B}, {k1}, {V}] (k drafts + bonus).")
    if draft_probs is not None and draft_probs.shape != (B, k1 - 1, V):
        raise ValueError(f"{name}: draft_probs has shape {tuple(draft_probs.shape)}, expected "
                         f"[{B}, {k1 - 1}, {V}]; pass None for proposers without probabilities.")
    return B, k1 - 1, V


def greedy_chain_verdict(target_argmax: torch.Tensor,  # [B, k+1] int64 on the CPU
                         draft_token_ids: torch.Tensor,  # [B, k] int64, -1 = padding
                         ) -> Verdict:
    """The torch kernels' greedy verification of a chain (specdec_kernels/greedy_verify.py, then the path) for a step's
    few rows, in lists: accept while the draft equals the target's argmax, emit the argmax up to and including the
    first mismatch. The same tensors as the kernel's; ~10 tensor ops on the caches a forward left cost 0.2 ms a step."""
    am, drafts = target_argmax.tolist(), draft_token_ids.tolist()
    k1 = len(am[0]) if am else draft_token_ids.shape[1] + 1
    path, out = [], []
    for row, d in zip(am, drafts):
        n = 0
        while n < k1 - 1 and d[n] == row[n]:
            n += 1
        pad = [-1] * (k1 - 1 - n)
        path.append(list(range(n + 1)) + pad)
        out.append(row[: n + 1] + pad)
    return Verdict(path=torch.tensor(path, dtype=torch.long).view(-1, k1),
                   out=torch.tensor(out, dtype=torch.long).view(-1, k1))


class _Verifier(torch.nn.Module, SpeculativeVerifier):
    """Shared: kernel dispatch, greedy matching, the SamplingParams-level :meth:`verify`, and the
    worker's :meth:`verify_proposals` (chains here; trees through :class:`specdec.verify.tree.TreeVerifier`)."""

    takes_target_argmax = True

    def verify_proposals(self, target_logits: torch.Tensor,  # [B, N+1, V] float raw, root-inclusive
                         proposals: SpeculativeProposals, root_token_ids: torch.Tensor,  # [B]
                         params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                         target_argmax: torch.Tensor | None = None,  # [B, N+1] int64 argmax of target_logits, if known
                         ) -> Verdict:
        if proposals.noise_width is not None or not proposals.is_chain:  # (a verify_tree of the older signature
            extra = () if target_argmax is None else (target_argmax,)  # still works without an argmax)
            return self.verify_tree(target_logits, proposals, root_token_ids, params, generators, *extra)
        if (target_argmax is not None and self.kernel == "torch" and target_argmax.device.type == "cpu"
                and target_argmax.numel() <= 256 and all(p.temperature == 0.0 for p in params)):
            return greedy_chain_verdict(target_argmax, proposals.token_ids)
        q = proposals.draft_probs
        out = self.verify(target_logits, proposals.token_ids.to(target_logits.device),
                          None if q is None else q.to(target_logits.device), params, generators,
                          target_argmax).cpu()  # [B, k+1]
        n = num_accepted_tokens(out)  # [B]
        j = torch.arange(out.shape[1])
        return Verdict(path=torch.where(j[None, :] <= n[:, None], j[None, :], -1), out=out)

    def verify_tree(self, target_logits, proposals, root_token_ids, params, generators, target_argmax=None) -> Verdict:
        raise ValueError(f"{type(self).__name__} verifies chains only; a tree (scorer=tree) needs "
                         "acceptance_method='rejection_sampler'")

    def __init__(self, kernel: str = "torch"):
        super().__init__()
        self.kernel = kernel
        self.ops = get_ops(kernel)  # ValueError listing the known backends for an unknown name

    def forward_greedy(self, target_argmax: torch.Tensor,  # [B, k+1] int64
                       draft_token_ids: torch.Tensor,  # [B, k] int64, -1 = padding
                       ) -> torch.Tensor:  # [B, k+1] int64
        """Exact greedy matching: accept while draft == argmax; then emit the target's argmax."""
        return self.ops.greedy_verify(target_argmax, draft_token_ids)

    def _verify_random(self, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                       draft_token_ids: torch.Tensor,
                       generators: Mapping[int, torch.Generator]) -> torch.Tensor:
        """[M, k+1, V] processed target probs -> [M, k+1] output, bonus sampled here from p_k."""
        raise NotImplementedError

    def verify(self, target_logits: torch.Tensor,  # [B, k+1, V] float raw target logits
               draft_token_ids: torch.Tensor,  # [B, k] int64, -1 = padding past proposal_len
               draft_probs: torch.Tensor | None,  # [B, k, V] float, None = one-hot drafts (n-gram)
               params: Sequence[SamplingParams],  # [B]
               generators: Sequence[torch.Generator | None] | None = None,  # [B], None = unseeded
               target_argmax: torch.Tensor | None = None,  # [B, k+1] int64 argmax of target_logits, if known
               ) -> torch.Tensor:  # [B, k+1] int64 emitted tokens, -1 after
        """Verify from raw target logits: the request's temperature/top-k/top-p/min-p are applied to the
        target at every position, greedy rows are matched exactly, the others go to the sampler's rule."""
        B, k, V = _check_shapes(type(self).__name__ + ".verify", target_logits, draft_token_ids, draft_probs)
        if len(params) != B:
            raise ValueError(f"{type(self).__name__}.verify: {len(params)} SamplingParams for {B} rows.")
        split = split_rows(params, target_logits.device)
        greedy_out = None
        if len(split.rows) < B:
            greedy_out = self.forward_greedy(argmax_last(target_logits) if target_argmax is None else target_argmax,
                                             draft_token_ids)
            if not split.rows:
                return greedy_out
        if len(split.rows) == B:
            logits, d_ids, d_probs = target_logits, draft_token_ids, draft_probs
        else:
            rows = torch.tensor(split.rows, device=target_logits.device)
            logits, d_ids = target_logits.index_select(0, rows), draft_token_ids.index_select(0, rows)
            d_probs = None if draft_probs is None else draft_probs.index_select(0, rows)
        M = len(split.rows)
        probs = split.st_random.expand(k + 1, kernel=self.kernel).to_probs(
            logits.reshape(M * (k + 1), V), kernel=self.kernel).view(M, k + 1, V)
        gens = split.generators(generators)
        rand_out = self._verify_random(probs, d_probs, d_ids, gens)
        if greedy_out is None:
            return rand_out
        return greedy_out.index_copy(0, rows, rand_out)


class RejectionSampler(_Verifier):
    """Lossless speculative sampling (vLLM v0 semantics); see the module docstring for conventions.

    Randomness per row: k uniforms, then one [V] Exp(1) row (shared by the recovered and the bonus token,
    of which exactly one is emitted). Rows in ``seeded_seqs`` draw both from their generator.
    """

    verifies_trees = True

    def __init__(self, kernel: str = "torch"):
        super().__init__(kernel)
        self.tree = TreeVerifier(kernel)  # the same rule over a token tree

    def verify_tree(self, target_logits, proposals, root_token_ids, params, generators, target_argmax=None) -> Verdict:
        return self.tree.verify_proposals(target_logits, proposals, root_token_ids, params, generators, target_argmax)

    def forward(self, target_with_bonus_probs: torch.Tensor,  # [B, k+1, V] float
                bonus_token_ids: torch.Tensor,  # [B, 1] int64, emitted when all k drafts are accepted
                draft_probs: torch.Tensor | None,  # [B, k, V] float, None = one-hot drafts
                draft_token_ids: torch.Tensor,  # [B, k] int64, -1 = padding
                seeded_seqs: Mapping[int, torch.Generator] | None = None,  # row -> generator
                ) -> torch.Tensor:  # [B, k+1] int64
        B, k, V = _check_shapes("RejectionSampler", target_with_bonus_probs, draft_token_ids, draft_probs)
        accepted, final = self._accept_and_sample(target_with_bonus_probs, draft_probs, draft_token_ids,
                                                  seeded_seqs or {})
        return self.ops.create_output(accepted, draft_token_ids, final, bonus_token_ids.reshape(B))

    def _verify_random(self, target_probs, draft_probs, draft_token_ids, generators):
        accepted, final = self._accept_and_sample(target_probs, draft_probs, draft_token_ids, generators)
        return self.ops.create_output(accepted, draft_token_ids, final, final)

    def _accept_and_sample(self, target_probs: torch.Tensor,  # [B, k+1, V]
                           draft_probs: torch.Tensor | None, draft_token_ids: torch.Tensor,
                           generators: Mapping[int, torch.Generator],
                           ) -> tuple[torch.Tensor, torch.Tensor]:  # accepted [B, k] bool, final [B]
        B, k = draft_token_ids.shape
        V = target_probs.shape[-1]
        uniform = draw_uniform(B, k, generators, device=target_probs.device)  # [B, k]
        exp_noise = draw_exponential(B, V, generators, device=target_probs.device)  # [B, V]
        accepted = self.ops.rejection_accept(target_probs, draft_probs, draft_token_ids, uniform)
        n = self.ops.num_accepted(accepted)  # [B]: first rejection, or k (bonus)
        final = self.ops.sample_recovered(target_probs, draft_probs, draft_token_ids, n, exp_noise)
        return accepted, final


class TypicalAcceptanceSampler(_Verifier):
    """Typical acceptance (Medusa sec. 3.3.1, vLLM v0 rule). LOSSY: the output is not distributed as p.

    Draft x is accepted iff p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p))); the first
    rejected position emits argmax p, so every row emits at least one token. Deterministic given p and
    the drafts (``draft_probs`` and ``seeded_seqs`` are accepted for call compatibility and unused);
    :meth:`verify` draws only the bonus token ~ p_k, from the row's generator when it has one.
    """

    def __init__(self, posterior_threshold: float = 0.09, posterior_alpha: float = 0.3,
                 kernel: str = "torch"):
        super().__init__(kernel)
        if not (0.0 < posterior_threshold <= 1.0 and posterior_alpha > 0.0):
            raise ValueError(f"TypicalAcceptanceSampler: posterior_threshold={posterior_threshold} must be "
                             f"in (0, 1] and posterior_alpha={posterior_alpha} > 0 (defaults 0.09, 0.3).")
        self.posterior_threshold = posterior_threshold
        self.posterior_alpha = posterior_alpha

    @classmethod
    def from_config(cls, config) -> "TypicalAcceptanceSampler":
        return cls(config.posterior_threshold, config.posterior_alpha, kernel=config.kernel)

    def forward(self, target_with_bonus_probs: torch.Tensor,  # [B, k+1, V] float
                bonus_token_ids: torch.Tensor,  # [B, 1] int64
                draft_probs: torch.Tensor | None,  # unused
                draft_token_ids: torch.Tensor,  # [B, k] int64, -1 = padding
                seeded_seqs: Mapping[int, torch.Generator] | None = None,  # unused
                ) -> torch.Tensor:  # [B, k+1] int64
        B, k, V = _check_shapes("TypicalAcceptanceSampler", target_with_bonus_probs, draft_token_ids, None)
        accepted, recovered = self._accept(target_with_bonus_probs, draft_token_ids)
        return self.ops.create_output(accepted, draft_token_ids, recovered, bonus_token_ids.reshape(B))

    def _verify_random(self, target_probs, draft_probs, draft_token_ids, generators):
        B, k = draft_token_ids.shape
        accepted, recovered = self._accept(target_probs, draft_token_ids)
        exp_noise = draw_exponential(B, target_probs.shape[-1], generators, device=target_probs.device)
        at_bonus = torch.full((B,), k, dtype=torch.int64, device=target_probs.device)
        bonus = self.ops.sample_recovered(target_probs, None, draft_token_ids, at_bonus, exp_noise)
        return self.ops.create_output(accepted, draft_token_ids, recovered, bonus)

    def _accept(self, target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor]:  # accepted [B, k] bool, recovered [B] int64
        B, k = draft_token_ids.shape
        accepted = self.ops.typical_accept(target_probs, draft_token_ids, self.posterior_threshold,
                                           self.posterior_alpha)
        n = self.ops.num_accepted(accepted).clamp(max=max(k - 1, 0))  # recovered is unused when n == k
        rows = torch.arange(B, device=target_probs.device)
        return accepted, target_probs[rows, n].argmax(dim=-1)
