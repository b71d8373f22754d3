"""MLPSpeculatorProposer: IBM's MLP speculator drafts a chain from the target's last hidden state.

Wertheimer et al. 2024, "Accelerating Production LLMs with Combined Token/Embedding Speculators"
(fms-extras ``MLPSpeculator``). Stage i (i < n_predict) reads a state s and the previous token t:

    s <- GELU(LN_i(proj_i(s) + (emb_weight / state_weight) * emb_i(t)))      # [b, inner_dim]
    logits_i = head_i(s)                                                     # [b, V]

s starts as the target's hidden state that produced the pending token (optionally normalised and
divided by sqrt(2): ``scale_input``) and t as the pending token; the token drafted by stage i is t for
stage i+1. ``state_weight = 0.5 ** (0.5 / n_predict)`` and ``emb_weight = sqrt((1 - state_weight^2) *
inner_dim / 2)`` keep the state's and the embedding's shares of the variance fixed; the weighted sum is
divided by state_weight so the LN that follows absorbs the denominator (as IBM's code does). LN_i is
IBM's ``LayerNormParameterized`` as used there: RMS normalisation (no mean), eps 1e-6, scale and shift.

Like Medusa it keeps no per-sequence state: one ``HiddenStates`` row (the last per sequence) is all it
reads. Greedy rows take each stage's argmax; the others draw from q_i (the request's processed
distribution of stage i, conditioned on the drawn tokens before it) and return q. Chain only.
speculative_config: ``model`` or ``options.head`` = a checkpoint directory (``tiny-random-llama`` =
seeded random weights shaped like the target), ``options.head_module`` = an in-process
:class:`MLPSpeculator`. A target-tied checkpoint (``specdec_target_tied`` in its config.json; what
train_mlp_speculator.py exports by default) gets its emb / head from the target's input embedding and LM
head, through the engine's ``embed`` / ``compute_logits``. Knows nothing about verification or KV caches.
"""

from __future__ import annotations

import torch

from specdec.engine import ModelEngine
from specdec.heads.common import CHECKPOINTS, load_head_module
from specdec.heads.mlp_speculator import (MLPSpeculator, MLPSpeculatorConfig, check_mlp_speculator_fits,
                                          load_mlp_speculator, random_mlp_speculator)
from specdec.sampling.sampler import SamplingTensors
from specdec.datamodel.sampling_params import SamplingParams
from specdec.spec_decode.draft_sampling import greedy_free, sample_draft
from specdec.spec_decode.proposer import DraftOutput, FeatureSpec, Proposer, ProposeBatch

__all__ = ["MLPSpeculatorProposer"]

DEFAULT_HEAD = CHECKPOINTS / "smollm2-135m-instruct-mlp-speculator"
_GREEDY = SamplingParams(temperature=0.0)


class MLPSpeculatorProposer(Proposer):
    """IBM's MLP speculator, chain drafting (module docstring)."""

    option_keys = frozenset({"head", "head_module", "n_predict", "inner_dim", "seed"})  # read from config.options

    @classmethod
    def config_keys(cls, spec):
        return frozenset({"model"})  # the head's checkpoint (options.head first)

    features = FeatureSpec(history=1)  # the state that produced the pending token

    def __init__(self, target: ModelEngine, config) -> None:
        super().__init__(target, config)
        opts = config.options
        model = opts.get("head_module")
        self.head_name = "<in-process speculator>"
        if model is None:
            path = opts.get("head") or config.model or DEFAULT_HEAD
            self.head_name = str(path)
            model = load_head_module(path, "MLPSpeculatorProposer", lambda p: load_mlp_speculator(p, target),
                                     lambda: self._random(opts),
                                     "give a checkpoint directory (config.json + model.safetensors)")
        self.model: MLPSpeculator = model
        c = model.cfg
        check_mlp_speculator_fits(c, target.hidden_size, target.vocab_size, self.head_name)
        if config.num_speculative_tokens > c.n_predict:
            raise ValueError(f"MLPSpeculatorProposer: num_speculative_tokens={config.num_speculative_tokens} but "
                             f"{self.head_name} has n_predict={c.n_predict} stages; use num_speculative_tokens <= "
                             f"{c.n_predict}")
        self.model.to(device=target.device, dtype=target.dtype).eval()

    def _random(self, opts) -> MLPSpeculator:
        t = self.target
        n = opts.get("n_predict") or self.config.num_speculative_tokens
        return random_mlp_speculator(MLPSpeculatorConfig(n_predict=n, emb_dim=t.hidden_size,
                                                         inner_dim=opts.get("inner_dim") or t.hidden_size,
                                                         vocab_size=t.vocab_size), seed=opts.get("seed", 0))

    def propose(self, batch: ProposeBatch) -> DraftOutput:
        dev = self.target.device
        h = torch.stack([rows[-1] for rows in batch.feature_rows()]).to(dev, self.target.dtype)  # [B, E]
        tok = torch.tensor([t[-1] for t in batch.token_ids], device=dev)  # the pending tokens
        params = [p or _GREEDY for p in batch.sampling_params]
        st = SamplingTensors.from_params(params, device=dev)
        gens = greedy_free(params, batch.generators)
        drafts, probs = [], []
        with torch.inference_mode():
            state = self.model.first_state(h)
            for i in range(batch.k):
                state, logits = self.model.stage(i, state, tok)
                tok, q = sample_draft(logits, st, gens, self.config.kernel)
                drafts.append(tok)
                probs.append(q)
        return DraftOutput(token_ids=torch.stack(drafts, 1), probs=None if st.all_greedy else torch.stack(probs, 1))
