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
:class:`MLPSpeculator`. Knows nothing about verification or KV caches.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn as nn

from proposers.medusa import REPO, last_rows, sample_from
from specdec.engine import ModelEngine
from specdec.heads.mlp_speculator import MLPSpeculatorConfig, check_mlp_speculator_fits, read_mlp_speculator
from specdec.sampling import SamplingTensors
from specdec.sampling_params import SamplingParams
from specdec.spec_decode.proposer import DraftOutput, Proposer, ProposeBatch

__all__ = ["MLPSpeculator", "MLPSpeculatorProposer", "load_mlp_speculator", "random_mlp_speculator"]

DEFAULT_HEAD = REPO / "heads" / "smollm2-135m-instruct-mlp-speculator"
_GREEDY = SamplingParams(temperature=0.0)


class RMSLayerNorm(nn.Module):
    """IBM's LayerNormParameterized(use_mean=False, elementwise scale and shift), eps 1e-6."""

    def __init__(self, dim: int, affine: bool = True, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x if self.weight is None else x * self.weight + self.bias


class MLPSpeculator(nn.Module):
    """Module names = the checkpoint's: ``emb.{i}``, ``proj.{i}``, ``head.{i}``, ``ln.{i}``."""

    def __init__(self, cfg: MLPSpeculatorConfig) -> None:
        super().__init__()
        self.cfg = cfg
        n, E, I, V = cfg.n_predict, cfg.emb_dim, cfg.inner_dim, cfg.vocab_size
        if cfg.tie_weights:  # one emb/head/ln for every stage; proj.0 reads E wide, proj.1 is shared after it
            emb, head, ln, proj1 = nn.Embedding(V, I), nn.Linear(I, V, bias=False), RMSLayerNorm(I), nn.Linear(I, I, bias=False)
            self.emb, self.head, self.ln = (nn.ModuleList([m] * n) for m in (emb, head, ln))
            self.proj = nn.ModuleList([nn.Linear(E, I, bias=False)] + [proj1] * (n - 1))
        else:
            self.emb = nn.ModuleList(nn.Embedding(V, I) for _ in range(n))
            self.proj = nn.ModuleList(nn.Linear(E if i == 0 else I, I, bias=False) for i in range(n))
            self.head = nn.ModuleList(nn.Linear(I, V, bias=False) for _ in range(n))
            self.ln = nn.ModuleList(RMSLayerNorm(I) for _ in range(n))
        self.ln0 = RMSLayerNorm(E, affine=False) if cfg.scale_input else None
        self.state_weight = 0.5 ** (0.5 / n)
        self.emb_weight = math.sqrt((1 - self.state_weight ** 2) * (I / 2))
        self.act = nn.GELU()

    def first_state(self, h: torch.Tensor) -> torch.Tensor:
        """[b, E] the target's hidden state -> the state stage 0 reads."""
        return h if self.ln0 is None else self.ln0(h) / math.sqrt(2)

    def stage(self, i: int, state: torch.Tensor,  # [b, E or I]
              tokens: torch.Tensor,  # [b] int64 the previous token
              ) -> tuple[torch.Tensor, torch.Tensor]:  # new state [b, I], logits [b, V] float32
        s = self.proj[i](state) + self.emb[i](tokens) * (self.emb_weight / self.state_weight)
        s = self.act(self.ln[i](s))
        return s, self.head[i](s).float()


def random_mlp_speculator(cfg: MLPSpeculatorConfig, seed: int = 0) -> MLPSpeculator:
    """Seeded random weights (~1/sqrt(fan_in); LN scale ~1 + noise), for tests and debug runs."""
    g = torch.Generator().manual_seed(seed)
    m = MLPSpeculator(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():  # named_parameters visits a tied tensor once
            if name.startswith("ln."):
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return m.eval()


def load_mlp_speculator(path: str | Path) -> MLPSpeculator:
    cfg, sd, _ = read_mlp_speculator(path)
    m = MLPSpeculator(cfg)
    m.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    return m.eval()


class MLPSpeculatorProposer(Proposer):
    """IBM's MLP speculator, chain drafting (module docstring)."""

    needs_hidden_states = True

    def __init__(self, target: ModelEngine, config) -> None:
        super().__init__(target, config)
        opts = config.options
        model = opts.get("head_module")
        self.head_name = "<in-process speculator>"
        if model is None:
            path = opts.get("head") or config.model or DEFAULT_HEAD
            self.head_name = str(path)
            model = self._load(path, opts)
        self.model: MLPSpeculator = model
        c = model.cfg
        check_mlp_speculator_fits(c, target.hidden_size, target.vocab_size, self.head_name)
        if config.scorer == "tree":
            raise ValueError("MLPSpeculatorProposer drafts chains only; use scorer='mqa' (or 'batch_expansion')")
        if config.num_speculative_tokens > c.n_predict:
            raise ValueError(f"MLPSpeculatorProposer: num_speculative_tokens={config.num_speculative_tokens} but "
                             f"{self.head_name} has n_predict={c.n_predict} stages; use num_speculative_tokens <= "
                             f"{c.n_predict}")
        self.model.to(device=target.device, dtype=target.dtype).eval()

    def _load(self, path, opts) -> MLPSpeculator:
        if str(path) == "tiny-random-llama":
            t = self.target
            n = opts.get("n_predict") or self.config.num_speculative_tokens
            return random_mlp_speculator(MLPSpeculatorConfig(n_predict=n, emb_dim=t.hidden_size,
                                                             inner_dim=opts.get("inner_dim") or t.hidden_size,
                                                             vocab_size=t.vocab_size), seed=opts.get("seed", 0))
        p = Path(path).expanduser()
        if not p.exists() and not p.is_absolute() and (REPO / p).exists():
            p = REPO / p
        if not p.exists():
            raise FileNotFoundError(f"MLPSpeculatorProposer: no MLPSpeculator at {str(path)!r}; give a checkpoint "
                                    "directory (config.json + model.safetensors), or model=tiny-random-llama")
        return load_mlp_speculator(p)

    def propose(self, batch: ProposeBatch) -> DraftOutput:
        B, k = len(batch.seq_ids), batch.k
        token_ids = torch.full((B, k), -1, dtype=torch.long)
        lens = torch.zeros(B, dtype=torch.long)
        feats, row_of = last_rows(batch, self.model.cfg.emb_dim, type(self).__name__)
        act = [b for b, s in enumerate(batch.seq_ids) if s in row_of]
        if not act:
            return DraftOutput(token_ids=token_ids, probs=None, lens=lens)
        dev = self.target.device
        rows = torch.tensor([row_of[batch.seq_ids[b]] for b in act], device=feats.device)
        state = self.model.first_state(feats.index_select(0, rows).to(dev, self.target.dtype))  # [b, E]
        tok = torch.tensor([batch.token_ids[b][-1] for b in act], device=dev)  # the pending tokens
        params = [batch.sampling_params[b] or _GREEDY for b in act]
        st = SamplingTensors.from_params(params, device=dev)
        gens = [None if p.temperature == 0 else batch.generators[b] for p, b in zip(params, act)]
        drafts, probs = [], []
        with torch.inference_mode():
            for i in range(k):
                state, logits = self.model.stage(i, state, tok)
                tok, q = sample_from(logits, st, gens)
                drafts.append(tok)
                probs.append(q)
        sel = torch.tensor(act)
        token_ids[sel] = torch.stack(drafts, 1).cpu()
        lens[sel] = k
        q_full = None
        if not st.all_greedy:
            q_full = torch.zeros(B, k, self.target.vocab_size)
            q_full[sel] = torch.stack(probs, 1).cpu()
        return DraftOutput(token_ids=token_ids, probs=q_full, lens=lens)
