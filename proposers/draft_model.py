"""DraftModelProposer: a small model with its own KV slot per sequence drafts k tokens autoregressively.

Lazy catch-up. The draft slot of a sequence holds a prefix of its tokens. Before drafting, the proposer
feeds every token from the slot's length up to and including the pending one: the whole prompt on the
first call; after a step with a bonus token, [last accepted draft, bonus] (the draft never saw the last
draft, it only produced it); after plain steps, all tokens they added. That one forward gives d1; k-1
single-token forwards, batched across sequences, give d2..dk. The slot then holds L + k - 1 tokens, and
:meth:`verified` rolls it back to the accepted prefix. The proposer also remembers which token ids its
slot holds and re-syncs to the longest common prefix with what it is fed, so a missed ``verified`` costs
a recompute, never a draft conditioned on the wrong tokens.

Sampling: greedy rows (temperature 0) take the argmax; the others sample from q = the draft's processed
distribution (the request's temperature / top-k / top-p / min-p, via ``specdec.sampling.sampler``), drawing their
noise from the request's generator when it has one, and ``probs`` returns that q: rejection sampling is
lossless only when q is exactly what each draft was drawn from.

Subclasses change only where the draft engine comes from (:meth:`build_engine`); see layer_skip.py.
Knows nothing about verification or the target's KV cache.
"""

from __future__ import annotations

from typing import Any

import torch

from specdec.engine import ForwardBatch, ModelEngine
from specdec.sampling.sampler import SamplingTensors
from specdec.datamodel.sampling_params import SamplingParams
from specdec.spec_decode.draft_sampling import greedy_free, sample_draft
from specdec.spec_decode.proposer import DraftOutput, Proposer, ProposeBatch

_GREEDY = SamplingParams(temperature=0.0)  # for a group without SamplingParams


class DraftModelProposer(Proposer):
    option_keys = frozenset({"engine", "seed"})  # read from config.options

    @classmethod
    def config_keys(cls, spec):
        return frozenset({"model"})

    def __init__(self, target: ModelEngine, config) -> None:
        super().__init__(target, config)
        engine = config.options.get("engine")
        self.engine: ModelEngine = engine if engine is not None else self.build_engine(target, config)
        name = self._name()
        if self.engine.vocab_size != target.vocab_size:
            raise ValueError(
                f"{type(self).__name__}: draft {name} has vocab_size={self.engine.vocab_size} but the target has "
                f"vocab_size={target.vocab_size}; the draft must share the target's tokenizer and vocabulary: "
                "pick a draft of the same model family, or use method='ngram' / 'layer_skip'")
        if self.engine.max_model_len < target.max_model_len:
            raise ValueError(
                f"{type(self).__name__}: draft {name} has max_model_len={self.engine.max_model_len} < the "
                f"target's {target.max_model_len}; build the draft with max_model_len={target.max_model_len}")
        self.slot_of: dict[int, int] = {}  # seq_id -> draft KV slot
        self._held: dict[int, list[int]] = {}  # seq_id -> the token ids whose KV the slot holds

    @classmethod
    def check_config(cls, spec: dict[str, Any]) -> None:
        # subclasses that override build_engine (layer_skip) find their draft elsewhere
        if cls.build_engine is DraftModelProposer.build_engine and not spec.get("model") \
                and "engine" not in spec.get("options", {}):
            raise ValueError(f"proposer {cls.__module__}.{cls.__qualname__} needs a draft model and proposer.model is "
                             "not set; give one, e.g. proposer.model=smollm2-135m-instruct (or tiny-random-llama)")

    def _name(self) -> str:
        return repr(self.config.model) if self.config.model else type(self.engine).__name__

    def build_engine(self, target: ModelEngine, config) -> ModelEngine:
        """The draft engine (the factory hook subclasses override): ``config.model`` through load_engine,
        as many slots and as long a context as the target, the target's dtype and device."""
        if not config.model:
            raise ValueError(f"{type(self).__name__}: speculative_config model is not set; give the draft "
                             "model (an engine name, HF directory or .gguf), e.g. model='tiny-random-llama'")
        from specdec.engine.loader import load_engine

        return load_engine(config.model, num_slots=target.num_slots, max_model_len=target.max_model_len,
                           dtype=target.dtype, device=target.device, seed=config.options.get("seed", 0))

    # ------------------------------------------------------------------ state
    def _sync(self, seq_id: int, tokens: list[int]) -> list[int]:
        """Allocate or re-sync the sequence's slot; return the tokens to feed (>= 1: the pending one)."""
        slot = self.slot_of.get(seq_id)
        if slot is None:
            slot = self.slot_of[seq_id] = self.engine.allocate_slot()
            self._held[seq_id] = []
        held = self._held[seq_id]
        n = min(len(held), len(tokens) - 1)  # the pending token is always fed, so the slot ends before it
        if held[:n] != tokens[:n]:  # C-speed list compare; the slow scan runs only on a mismatch
            n = next(i for i in range(n) if held[i] != tokens[i])
        if n < len(held):
            self.engine.rollback(slot, n)
            del held[n:]
        return tokens[n:]

    def verified(self, seq_id: int, num_valid_tokens: int) -> None:
        held = self._held.get(seq_id)
        if held is not None and num_valid_tokens < len(held):
            self.engine.rollback(self.slot_of[seq_id], num_valid_tokens)
            del held[num_valid_tokens:]

    def free(self, seq_id: int) -> None:
        slot = self.slot_of.pop(seq_id, None)
        self._held.pop(seq_id, None)
        if slot is not None:
            self.engine.free_slot(slot)

    def snapshot(self, seq_ids: list[int]) -> dict[int, int | None]:
        """seq_id -> tokens its slot holds (None: no slot yet). A step only appends past them: the
        catch-up feeds from the held length (held is a prefix of the committed tokens), drafts and tree
        nodes go after it, so rolling back to it restores the draft's KV exactly."""
        return {s: len(self._held[s]) if s in self.slot_of else None for s in seq_ids}

    def restore(self, seq_ids: list[int], snapshot: dict[int, int | None]) -> None:
        for seq_id, n in snapshot.items():
            if n is None:
                self.free(seq_id)
            elif seq_id in self.slot_of:
                slot, held = self.slot_of[seq_id], self._held[seq_id]
                m = min(n, len(held), self.engine.seq_len(slot))
                self.engine.rollback(slot, m)
                del held[m:]

    # ------------------------------------------------------------------ drafting
    def propose(self, batch: ProposeBatch) -> DraftOutput:
        B, k = len(batch.seq_ids), batch.k
        dev = self.engine.device
        feeds = [self._sync(s, toks) for s, toks in zip(batch.seq_ids, batch.token_ids)]
        slots = [self.slot_of[s] for s in batch.seq_ids]
        params = [p if p is not None else _GREEDY for p in batch.sampling_params]
        st = SamplingTensors.from_params(params, device=dev)
        gens = greedy_free(params, batch.generators)

        qlens = [len(f) for f in feeds]
        flat = [t for f in feeds for t in f]
        last_rows = torch.tensor(qlens, device=dev).cumsum(0) - 1  # [B] each sequence's pending-token row
        logits = self.engine.forward(ForwardBatch(
            token_ids=torch.tensor(flat, dtype=torch.long, device=dev), slots=slots, query_lens=qlens,
            logits_indices=last_rows,
        )).logits  # [B, V]
        for f, held in zip(feeds, (self._held[s] for s in batch.seq_ids)):
            held.extend(f)

        tokens, probs = [], []
        for j in range(k):
            tok, q = sample_draft(logits, st, gens, self.config.kernel)  # [B], [B, V] or None
            tokens.append(tok)
            probs.append(q)
            if j == k - 1:
                break  # dk is never fed: the next step's catch-up (or the back-fill after a bonus) does it
            logits = self.engine.forward(ForwardBatch(token_ids=tok, slots=slots, query_lens=[1] * B)).logits
            for held, t in zip((self._held[s] for s in batch.seq_ids), tok.tolist()):
                held.append(t)
        token_ids = torch.stack(tokens, dim=1)  # [B, k]
        q = None if st.all_greedy else torch.stack(probs, dim=1)  # [B, k, V]; None = one-hot (all greedy)
        return DraftOutput(token_ids=token_ids, probs=q)
