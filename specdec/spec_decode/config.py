"""SpeculativeConfig: the keys of `LLM(speculative_config={...})`, typed so a typo is a clear error.

Each value is checked on its own here; whether the parts it names exist and fit together (a tree scorer with a
tree proposer and verifier, k within max_model_len, the kernel backend) is the builder's decision
(specdec.spec_decode.builder.check_parts; :func:`check_sizes` is its size rule)."""

from __future__ import annotations

from typing import Any

import msgspec

# Largest k (or tree depth / budget) accepted. The verifier holds [B, k+1, V] float32 probabilities: k=1000
# with SmolLM2's 49k vocabulary cost +1 GB of RSS in the issue #16 probe, for nothing (published chains
# use k <= 8, EAGLE-2 trees depth <= 10 and budgets <= 64).
MAX_SPECULATIVE_TOKENS = 64


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # proposer: a registered name ("ngram", "draft_model", "layer_skip", ...) or an import path,
    # "pkg.module:Class" or a Hydra _target_ "pkg.module.Class" (specdec.spec_decode.registry.resolve)
    method: str
    num_speculative_tokens: int = 4  # k
    model: str | None = None  # draft model (draft_model method): engine name, HF dir or .gguf
    num_layers: int | None = None  # layer_skip: how many of the target's first layers draft
    prompt_lookup_max: int = 4  # ngram: longest n-gram to match
    prompt_lookup_min: int = 1  # ngram: shortest n-gram to match
    # scorer / acceptance_method: registry names or import paths, as method
    scorer: str = "mqa"  # mqa | batch_expansion | tree (EAGLE-2 dynamic tree; needs a TreeProposer)
    tree_depth: int | None = None  # scorer=tree: longest draft path (None = num_speculative_tokens)
    tree_topk: int = 4  # scorer=tree: children expanded per node and nodes expanded per depth
    tree_budget: int = 16  # scorer=tree: draft nodes kept per step (the target scores budget + 1 tokens)
    acceptance_method: str = "rejection_sampler"  # rejection_sampler | typical_acceptance (lossy)
    posterior_threshold: float = 0.09  # typical acceptance (Medusa's defaults)
    posterior_alpha: float = 0.3
    kernel: str = "torch"  # ops backend for verification: torch | triton
    disable_by_batch_size: int | None = None  # no speculation while running_queue_size >= this
    options: dict[str, Any] = msgspec.field(default_factory=dict)  # extra kwargs for a plug-in proposer
    # how much each request drafts each step (specdec/spec_decode/policy.py): static (k every step) | batch_size |
    # acceptance_ema | goodput, or 'pkg.module:Class'; its keyword arguments in policy_options
    speculation_policy: str = "static"
    policy_options: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"speculative_config num_speculative_tokens={self.num_speculative_tokens} must be "
                             ">= 1 (drop speculative_config for plain decoding)")
        for key in ("tree_depth", "tree_topk", "tree_budget"):
            if (val := getattr(self, key)) is not None and val < 1:
                raise ValueError(f"speculative_config {key}={val} must be >= 1")
        if not (1 <= self.prompt_lookup_min <= self.prompt_lookup_max):
            raise ValueError(f"speculative_config prompt_lookup_min={self.prompt_lookup_min} / prompt_lookup_max="
                             f"{self.prompt_lookup_max}: need 1 <= min <= max")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"speculative_config disable_by_batch_size={self.disable_by_batch_size} must be >= 1 "
                             "or None")


def check_sizes(cfg: SpeculativeConfig, trees: bool, max_model_len: int) -> None:
    """Refuse a k (tree depth, budget when ``trees``) that could never or hardly ever speculate within
    max_model_len; one of the fit checks of specdec.spec_decode.builder.check_parts, which calls it.

    A step scores k+1 tokens (a tree: budget+1) past the sequence, so they must fit in half of
    max_model_len: sequences up to the other half then speculate."""
    sizes = {"num_speculative_tokens": cfg.num_speculative_tokens}
    if trees:
        sizes.update(tree_depth=cfg.tree_depth or cfg.num_speculative_tokens, tree_budget=cfg.tree_budget)
    for key, val in sizes.items():
        if val > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config {key}={val} is too large: at most {MAX_SPECULATIVE_TOKENS} "
                             "(each costs a [batch, vocab] probability row per step; typical k is 1-8)")
        if val + 1 > max_model_len // 2:
            raise ValueError(f"speculative_config {key}={val} is too large for max_model_len={max_model_len}: a "
                             f"step scores {key.split('_')[-1]}+1 tokens past the sequence, which must fit in "
                             f"max_model_len // 2 = {max_model_len // 2}; lower {key} or raise max_model_len")


def parse_speculative_config(raw: dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
    if isinstance(raw, SpeculativeConfig):
        return raw
    if "method" not in raw or raw["method"] is None:
        raise ValueError(f"speculative_config {raw} has no 'method'; give e.g. method='ngram'")
    try:
        return msgspec.convert(raw, SpeculativeConfig)
    except msgspec.ValidationError as e:
        fields = ", ".join(SpeculativeConfig.__struct_fields__)
        raise ValueError(f"invalid speculative_config: {e}. Valid keys: {fields}") from e
