"""EagleProposer (EAGLE-1 chain) on the tiny model, with heads built in-process (no trained weights):

- refusal of a head whose hidden size or vocabulary does not fit the target, naming both;
- greedy equality with plain decoding at batch 1 and in a ragged batch of 4, in three acceptance
  regimes: a random head (nothing accepted), an *oracle* head on a target whose next token depends only
  on the current one (everything accepted: a bonus token every step), and a perturbed oracle (partly);
- the head's KV after bonus steps equals that of a head fed the same pairs from scratch;
- sampling: q sums to 1 and every draft is drawn from it; the first two generated tokens follow the
  target's law (chi-square, as tests/spec_decode/test_sampling_lossless.py does for the other proposers).
Slow: the committed SmolLM2 head loads and keeps greedy outputs identical.
"""

from pathlib import Path

import pytest
import torch

from specdec_kernels.testing import chi_square_pvalue, counts_of
from proposers.eagle import EagleProposer
from specdec.heads import EagleHead, HeadConfig, build_head
from specdec import LLM, SamplingParams
from specdec.engine import ForwardBatch
from specdec.engine.llama import Llama
from specdec.engine.native import NativeEngine
from specdec.engine.tiny import tiny_config, tiny_random_llama, tiny_random_weights
from specdec.datamodel.hidden_states import HiddenStates
from specdec.spec_decode.config import SpeculativeConfig
from specdec.spec_decode.proposer import ProposeBatch
from tests.proposers.helpers import (FIRST_TWO_PROMPT, exact_first_two, LEN, RAGGED, RAGGED_MAX, generate_and_assert_greedy_equal, features, from_scratch_kv, greedy,
                                     simulate)

METHOD = "proposers.eagle:EagleProposer"


def random_head(cfg=None, seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)
    return build_head(HeadConfig.for_target(cfg or tiny_config(), "eagle"))


def spec(head, k: int = 3, **options) -> dict:
    return {"method": METHOD, "num_speculative_tokens": k, "options": {"head_module": head, **options}}


# ---------------------------------------------------------------------------------------------- refusal


@pytest.mark.parametrize("field, value", [("hidden_size", 32), ("vocab_size", 256)])
def test_a_head_that_does_not_fit_is_refused_naming_both(field, value):
    target = tiny_random_llama(0, num_slots=2, max_model_len=64)
    head = build_head(HeadConfig.for_target(tiny_config(), "eagle", **{field: value}))
    with pytest.raises(ValueError, match=rf"{field}={value} but the target has {field}={getattr(target, field)}"):
        EagleProposer(target, SpeculativeConfig(method=METHOD, options={"head_module": head}))


def test_an_eagle3_head_is_refused_by_the_eagle1_proposer():
    target = tiny_random_llama(0, num_slots=2, max_model_len=64)
    head = build_head(HeadConfig.for_target(tiny_config(), "eagle3", draft_vocab_size=64))
    with pytest.raises(ValueError, match="use method=eagle3"):
        EagleProposer(target, SpeculativeConfig(method=METHOD, options={"head_module": head}))


# ---------------------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("batch", ["batch1", "ragged4"])
def test_random_head_is_greedy_equal(tiny, batch):
    prompts, params = (([[1, 17, 42, 99, 3]], greedy(40)) if batch == "batch1"
                       else (RAGGED, [greedy(m) for m in RAGGED_MAX]))
    generate_and_assert_greedy_equal(tiny, spec(random_head(), 3), prompts, params)


def per_token_engine() -> NativeEngine:
    """A 1-layer tiny llama whose attention adds nothing (v = 0) and whose final norm has unit weight:
    its next token is a function of the current token only, computable by an EAGLE-1 head."""
    cfg = tiny_config(num_hidden_layers=1)
    sd = tiny_random_weights(cfg, 0)
    sd["model.layers.0.self_attn.v_proj.weight"].zero_()
    sd["model.norm.weight"] = torch.ones(cfg.hidden_size)
    return NativeEngine(Llama.from_hf_state_dict(cfg, sd), num_slots=4, max_model_len=LEN)


def oracle_head(noise: float = 0.0) -> EagleHead:
    """fc picks the embedding (x = e), v = 0 and the target's MLP and ffn norm: the head's output is the
    target's residual stream before its final norm, whose argmax under the LM head is the target's
    (the unit-weight final norm only rescales it). ``noise`` perturbs the MLP: partial acceptance."""
    cfg = tiny_config(num_hidden_layers=1)
    sd = tiny_random_weights(cfg, 0)
    D = cfg.hidden_size
    head = build_head(HeadConfig.for_target(cfg, "eagle"))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        head.fc.weight.copy_(torch.cat([torch.eye(D), torch.zeros(D, D)], 1))
        head.fc.bias.zero_()
        head.self_attn.v_proj.weight.zero_()
        for name in ("gate_proj", "up_proj", "down_proj"):
            w = sd[f"model.layers.0.mlp.{name}.weight"]
            getattr(head.mlp, name).weight.copy_(w + noise * w.std() * torch.randn(w.shape, generator=g))
        head.post_attention_layernorm.weight.copy_(sd["model.layers.0.post_attention_layernorm.weight"])
    return head


@pytest.fixture(scope="module")
def per_token():
    llm = LLM("tiny-random-llama", max_num_seqs=4, max_model_len=LEN)
    llm.engine = per_token_engine()  # with_speculation() builds its workers on this engine
    return llm


# (prompts, max_tokens, noise, acceptance range): the per-token target falls into short cycles, so a
# perturbed head is right on whole cycles or not at all; these settings give partial acceptance.
ORACLE = {
    "batch1": ([[1, 17, 42, 99, 3]], [40], 0.0, (0.999, 1.0)),
    "ragged4": (RAGGED, RAGGED_MAX, 0.0, (0.999, 1.0)),
    "batch1_partial": ([RAGGED[1]], [40], 0.1, (0.1, 0.95)),
    "ragged4_partial": (RAGGED, RAGGED_MAX, 0.2, (0.1, 0.95)),
}


@pytest.mark.parametrize("name", list(ORACLE))
def test_oracle_head_is_greedy_equal_and_accepted(per_token, name):
    prompts, max_tokens, noise, (lo, hi) = ORACLE[name]
    llm = generate_and_assert_greedy_equal(per_token, spec(oracle_head(noise), 3), prompts, [greedy(m) for m in max_tokens])
    m = llm.get_metrics()
    assert lo <= m.acceptance_rate <= hi, f"acceptance {m.acceptance_rate} outside [{lo}, {hi}]"
    if noise == 0.0:
        assert m.mean_acceptance_length > 3.5  # k + 1 = 4 on every step but the last of each request


# ---------------------------------------------------------------------------------------------- EAGLE-2 tree


def tree_spec(head, depth: int, topk: int, budget: int, **options) -> dict:
    return {**spec(head, depth, **options), "scorer": "tree", "tree_depth": depth, "tree_topk": topk,
            "tree_budget": budget}


@pytest.mark.parametrize("batch", ["batch1", "ragged4"])
def test_random_head_tree_is_greedy_equal(tiny, batch):
    prompts, params = (([[1, 17, 42, 99, 3]], greedy(40)) if batch == "batch1"
                       else (RAGGED, [greedy(m) for m in RAGGED_MAX]))
    llm = generate_and_assert_greedy_equal(tiny, tree_spec(random_head(), 4, 3, 10), prompts, params)
    head = llm.worker.top1.proposer.head
    assert head.cache.num_free() == head.cache.num_slots, "head KV slots leaked"


@pytest.mark.parametrize("topk, budget", [(1, 4), (3, 12)])
def test_oracle_head_tree_accepts_the_whole_depth(per_token, topk, budget):
    """A head that predicts the target exactly. As a chain (topk 1) every step accepts depth drafts (tau =
    depth + 1 but for each request's last steps); a bushy tree always accepts its first draft, and goes
    deeper only where the budget kept the greedy path over shallower siblings (the tiny target is flat,
    so EAGLE-2's reranking by cumulative draft probability often prefers the siblings)."""
    prompts, max_tokens = ORACLE["ragged4"][:2]
    llm = generate_and_assert_greedy_equal(per_token, tree_spec(oracle_head(), 4, topk, budget), prompts,
                              [greedy(m) for m in max_tokens])
    m = llm.get_metrics()
    assert m.acceptance_counts[1] == m.acceptance_counts[0]  # the first draft always accepted
    assert m.mean_acceptance_length > (4.0 if topk == 1 else 2.5)


def test_noisy_head_tree_accepts_more_than_its_chain(per_token):
    """A perturbed head: the EAGLE-2 tree (depth 3, top-3, 9 nodes) accepts more per step than the chain
    of the same depth, through paths that leave the head's top-1 (greedy equality holds for both)."""
    prompts, max_tokens = RAGGED, RAGGED_MAX
    params = [greedy(m) for m in max_tokens]
    chain = generate_and_assert_greedy_equal(per_token, spec(oracle_head(0.3), 3), prompts, params).get_metrics()
    tree = generate_and_assert_greedy_equal(per_token, tree_spec(oracle_head(0.3), 3, 3, 9), prompts, params).get_metrics()
    assert chain.mean_acceptance_length < 3.9, "the noise must leave room for the tree to help"
    assert tree.mean_acceptance_length > chain.mean_acceptance_length


def test_tree_first_two_tokens_follow_the_target():
    """Sampling through an EAGLE-2 tree (deterministic top-k nodes, multi-draft recursive rejection):
    the joint law of (t1, t2) over 2048 requests is the target's (chi-square p > 1e-3)."""
    V, prompt, n = 512, FIRST_TWO_PROMPT, 2048
    p1, joint = exact_first_two()
    llm = LLM("tiny-random-llama", max_num_seqs=256, max_model_len=24,
              speculative_config=tree_spec(random_head(), 2, 3, 5))
    outs = llm.generate([{"prompt_token_ids": prompt}] * n,
                        SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    toks = torch.tensor([o.outputs[0].token_ids for o in outs])
    pval = chi_square_pvalue(counts_of(toks[:, 0] * V + toks[:, 1], V * V), joint)
    assert pval > 1e-3, f"joint (t1, t2) chi-square p-value {pval:.2e}"


# ---------------------------------------------------------------------------------------------- n-gram branch
@pytest.mark.parametrize("batch", ["batch1", "ragged4"])
def test_ngram_branch_is_greedy_equal_and_adds_accepted_tokens(tiny, batch):
    """options.ngram_branch: the random head's tree (which accepts next to nothing) plus a prompt-lookup path:
    greedy output equals plain decoding, no slot leaks, and the branch is what gets accepted."""
    prompts, params = (([RAGGED[2]], [greedy(40)]) if batch == "batch1"
                       else (RAGGED, [greedy(m) for m in RAGGED_MAX]))
    plain_tree = generate_and_assert_greedy_equal(tiny, tree_spec(random_head(), 3, 3, 6), prompts, params)
    hybrid = generate_and_assert_greedy_equal(tiny, tree_spec(random_head(), 3, 3, 6, ngram_branch=3), prompts, params)
    head = hybrid.worker.top1.proposer.head
    assert head.cache.num_free() == head.cache.num_slots, "head KV slots leaked"
    a, b = plain_tree.get_metrics(), hybrid.get_metrics()
    assert b.mean_acceptance_length > a.mean_acceptance_length + 0.2, (a.mean_acceptance_length, b.mean_acceptance_length)


def test_ngram_branch_past_the_heads_depth_is_greedy_equal_and_counted(tiny):
    """A branch longer than the head's depth (m = 5 on a depth-2 tree): greedy output equals plain decoding, steps
    accept past depth 2, and every accepted draft is counted: the counters span the longest path (positions 0..5;
    counters of the depth's length dropped the drafts accepted past it, and tau read low)."""
    prompts, params = [RAGGED[2]], [greedy(40)]
    hybrid = generate_and_assert_greedy_equal(tiny, tree_spec(random_head(), 2, 3, 6, ngram_branch=5), prompts, params)
    assert hybrid.llm_engine.num_speculative_tokens == 5 and hybrid.worker.top1.max_path == 5
    m = hybrid.get_metrics()
    assert len(m.acceptance_counts) == 6 and sum(m.acceptance_counts[3:]) > 0, m.acceptance_counts


def test_ngram_branch_first_two_tokens_follow_the_target():
    """Sampling through a head tree with an n-gram path grafted on: the joint law of (t1, t2) over 2048
    requests is the target's (chi-square p > 1e-3). The prompt holds the tiny target's likeliest first tokens
    (31% of p1's mass), so for about a third of the requests t1 recurs and the lookup grafts a branch."""
    V, prompt, n = 512, [418, 457, 390, 459, 388, 476], 2048
    p1, joint = exact_first_two(prompt)
    llm = LLM("tiny-random-llama", max_num_seqs=256, max_model_len=24,
              speculative_config=tree_spec(random_head(), 2, 3, 5, ngram_branch=2))
    outs = llm.generate([{"prompt_token_ids": prompt}] * n,
                        SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    toks = torch.tensor([o.outputs[0].token_ids for o in outs])
    pval = chi_square_pvalue(counts_of(toks[:, 0] * V + toks[:, 1], V * V), joint)
    assert pval > 1e-3, f"joint (t1, t2) chi-square p-value {pval:.2e}"
    assert llm.get_metrics().num_draft_tokens > 3 * n + n // 5, "the grafted branch must add nodes past the head's 3"


@pytest.mark.parametrize("cfg, match", [
    (lambda h: spec(h, 3, ngram_branch=2), "use scorer=tree"),
    (lambda h: tree_spec(h, 2, 3, 6, ngram_branch=6), r"ngram_branch=6 needs m < tree_budget=6"),
    (lambda h: tree_spec(h, 3, 3, 3, ngram_branch=3), r"m < tree_budget=3"),
    (lambda h: tree_spec(h, 3, 3, 6, ngram_branch=-1), r"ngram_branch=-1 must be an int >= 0"),
])
def test_ngram_branch_misuse_is_refused_naming_the_way_out(tiny, cfg, match):
    with pytest.raises(ValueError, match=match):
        tiny.with_speculation(cfg(random_head()))
    with pytest.raises(ValueError, match=match):  # the Hydra path refuses it before any model loads
        EagleProposer.check_config(cfg(random_head()))
    assert tiny.engine.num_free_slots() == tiny.engine.num_slots


# ---------------------------------------------------------------------------------------------- KV threading


def test_head_kv_after_bonus_equals_a_head_fed_from_scratch():
    """Every pair 1..L-1 comes from the target's features (EAGLE's), whatever was accepted or drafted before."""
    k = 3
    target, ref_engine = tiny_random_llama(0, num_slots=4, max_model_len=LEN), tiny_random_llama(0, max_model_len=LEN)
    prop = EagleProposer(target, SpeculativeConfig(method=METHOD, num_speculative_tokens=k,
                                                   options={"head_module": random_head()}))
    checked = []

    def check(s, tokens, bonus):
        slot, L = prop.pairs.slot_of[s], len(tokens)
        k_ref, v_ref = from_scratch_kv(prop.head, tokens, features(ref_engine, tokens[:-1]), target.embed)
        kc, vc = prop.head.cache.k[0, slot], prop.head.cache.v[0, slot]
        assert prop.head.cache.seq_len(slot) == (L - 1) + (k - 1)  # then k-1 draft pairs
        torch.testing.assert_close(kc[:, :L - 1], k_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vc[:, :L - 1], v_ref, atol=1e-5, rtol=1e-5)
        checked.append(bonus)

    simulate(prop, target, [[1, 5, 6, 7, 8], list(range(3, 30))], k, steps=7, check=check)
    assert sum(checked) >= 4, "no bonus step was checked"
    prop.free(0)
    assert 0 not in prop.pairs.slot_of and prop.head.cache.num_free() == target.num_slots - 1


def test_options_features_is_refused_naming_the_way_out():
    target = tiny_random_llama(0, num_slots=2, max_model_len=LEN)
    with pytest.raises(ValueError, match="options.features is gone.*drop the option"):
        EagleProposer(target, SpeculativeConfig(method=METHOD, options={"head_module": random_head(),
                                                                         "features": "exact"}))


# ---------------------------------------------------------------------------------------------- sampling


def test_sampled_drafts_come_with_their_q():
    target = tiny_random_llama(0, num_slots=2, max_model_len=LEN)
    prop = EagleProposer(target, SpeculativeConfig(method=METHOD, options={"head_module": random_head()}))
    prompts = [[1, 5, 6, 7], [1, 2, 3]]
    feats = torch.cat([features(target, p)[-1:] for p in prompts])
    params = [SamplingParams(temperature=0.8, top_k=20, seed=1), SamplingParams(temperature=0.0)]
    out = prop.propose(ProposeBatch([0, 1], [p + [11] for p in prompts], 4, params,
                                    [torch.Generator().manual_seed(1), None], HiddenStates(feats, _seq_ids=[0, 1])))
    q = out.probs
    assert q.shape == (2, 4, 512)
    torch.testing.assert_close(q.sum(-1), torch.ones(2, 4))
    picked = q.gather(2, out.token_ids[..., None])[..., 0]
    assert (picked > 0).all()  # each draft was drawn from its own q
    assert ((q[0] > 0).sum(-1) <= 20).all()  # top-k applied to q
    assert (picked[1] == 1).all()  # the greedy row's q is one-hot at its draft


def test_first_two_tokens_follow_the_target():
    """2048 requests of 2 tokens at temperature 1 with a random head (q far from p): the joint law of
    (t1, t2) is the target's (chi-square p > 1e-3; all 512 x 512 cells computed exactly)."""
    V, prompt, n = 512, FIRST_TWO_PROMPT, 2048
    p1, joint = exact_first_two()
    llm = LLM("tiny-random-llama", max_num_seqs=256, max_model_len=16, speculative_config=spec(random_head(), 2))
    outs = llm.generate([{"prompt_token_ids": prompt}] * n,
                        SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    toks = torch.tensor([o.outputs[0].token_ids for o in outs])
    pval = chi_square_pvalue(counts_of(toks[:, 0] * V + toks[:, 1], V * V), joint)
    assert pval > 1e-3, f"joint (t1, t2) chi-square p-value {pval:.2e}"
    assert llm.get_metrics().num_draft_tokens == 2 * n


def features_logits(engine, tokens):
    slot = engine.allocate_slot()
    out = engine.forward(ForwardBatch(torch.tensor(tokens), [slot], [len(tokens)]))
    engine.free_slot(slot)
    return out.logits[-1].double()


# ---------------------------------------------------------------------------------------------- slow

HEAD = Path(__file__).resolve().parents[2] / "checkpoints" / "smollm2-135m-instruct-eagle"


@pytest.mark.slow
@pytest.mark.skipif(not (HEAD / "model.safetensors").is_file(), reason="trained head not committed yet")
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_trained_head_is_greedy_equal_on_smollm2(shape):
    llm = LLM("smollm2-135m-instruct", max_num_seqs=2, max_model_len=512)
    prompts = [{"prompt_token_ids": llm.chat_prompt_ids([{"role": "user", "content": q}])}
               for q in ("What is the capital of France? Answer in one sentence.", "Write a haiku about rain.")]
    sp = SamplingParams(temperature=0.0, max_tokens=32)
    cfg = {"method": METHOD, "num_speculative_tokens": 4, "options": {"draft_vocab_size": 2048}}
    if shape == "tree":
        cfg.update(scorer="tree", tree_depth=4, tree_topk=4, tree_budget=12)
    eagle = llm.with_speculation(cfg)
    got = eagle.generate(prompts, sp, use_tqdm=False)
    want = llm.without_speculation().generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    # a random head gets tau ~1.0 here; the trained one ~1.5 (chain) on these two prompts
    assert eagle.get_metrics().mean_acceptance_length > 1.3


@pytest.mark.parametrize("head_dtype", ["float32", "bfloat16", "auto"])
def test_head_pack_dtype_keeps_greedy_equality(tiny, head_dtype):
    """The head's projections packed in bf16 (half the bytes a draft step reads) change only the drafts."""
    from specdec.engine.cpu.ops import lib

    llm = generate_and_assert_greedy_equal(tiny, spec(random_head(), 3, head_dtype=head_dtype), RAGGED,
                                           [greedy(m) for m in RAGGED_MAX])
    prop = llm.worker.top1.proposer
    if lib() is not None and head_dtype == "bfloat16":
        assert prop.head.fc.nw.w.dtype == torch.bfloat16 and prop.lm._native.w.dtype == torch.bfloat16


def test_head_dtype_is_checked():
    target = tiny_random_llama(0, num_slots=2, max_model_len=LEN)
    with pytest.raises(ValueError, match="options.head_dtype='fp8'; choose float32, bfloat16 or auto"):
        EagleProposer(target, SpeculativeConfig(method=METHOD, options={"head_module": random_head(), "head_dtype": "fp8"}))


@pytest.mark.parametrize("depth, topk, budget, branch", [(3, 3, 6, 0), (4, 3, 10, 0), (3, 3, 6, 2)])
def test_batch1_fast_path_drafts_the_batched_trees(per_token, monkeypatch, depth, topk, budget, branch):
    """build_dynamic_tree's batch-1 fast path (head_expand's ``.row``) drafts exactly the trees of the batched
    tensor path, step after step, with a partly right head (so catch-up, bonus tokens and re-feeds all occur)."""
    import proposers.dynamic_tree as dt

    trees = {}
    orig = EagleProposer.propose_tree

    def spy(self, batch, shape):
        out = orig(self, batch, shape)
        trees[dt.ROW_FAST_PATH].append((out.token_ids.tolist(), out.parents.tolist(), out.num_nodes.tolist()))
        return out

    monkeypatch.setattr(EagleProposer, "propose_tree", spy)
    rows = []
    build_row = dt._build_row
    monkeypatch.setattr(dt, "_build_row", lambda *a: rows.append(1) or build_row(*a))
    prompts, max_tokens = RAGGED[1:2], [40]
    opts = {"tree_native": False, **({"ngram_branch": branch} if branch else {})}  # the python expansion's two paths
    for fast in (True, False):
        monkeypatch.setattr(dt, "ROW_FAST_PATH", fast)
        trees[fast] = []
        generate_and_assert_greedy_equal(per_token, tree_spec(oracle_head(0.3), depth, topk, budget, **opts), prompts,
                                         [greedy(m) for m in max_tokens])
    assert len(trees[True]) > 5 and trees[True] == trees[False]
    assert len(rows) == len(trees[True])  # every step of the fast run took the fast path, none of the other


@pytest.mark.parametrize("depth, topk, budget, branch, batch", [(3, 3, 6, 0, 1), (6, 4, 20, 0, 1), (3, 3, 6, 2, 1),
                                                                (4, 3, 10, 0, 4)])
def test_native_tree_drafts_the_python_trees(per_token, monkeypatch, depth, topk, budget, branch, batch):
    """The whole tree in one native call (options.tree_native, heads/draft_call.py) drafts exactly the trees of the
    re-feeding python expansion, step after step, with a partly right head, at batch 1 and in a ragged batch; both
    keep greedy equality."""
    trees = {}
    orig = EagleProposer.propose_tree

    def spy(self, batch_, shape):
        out = orig(self, batch_, shape)
        trees[self.tree_kernel == "native"].append((out.token_ids.tolist(), out.parents.tolist(), out.num_nodes.tolist()))
        return out

    monkeypatch.setattr(EagleProposer, "propose_tree", spy)
    prompts, max_tokens = (RAGGED[1:2], [40]) if batch == 1 else (RAGGED, RAGGED_MAX)
    for native in (True, False):
        trees[native] = []
        s = tree_spec(oracle_head(0.3), depth, topk, budget, tree_native=native, **({"ngram_branch": branch} if branch else {}))
        generate_and_assert_greedy_equal(per_token, s, prompts, [greedy(m) for m in max_tokens])
    assert len(trees[True]) > 5 and trees[True] == trees[False]
