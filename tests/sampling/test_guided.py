"""Structured outputs, the parts (specdec/sampling/guided.py, GuidedDecodingParams), on the tiny model's byte-level
tokenizer (ids 3..258 are the 256 bytes, 2 is EOS; xgrammar reads it as a BYTE_LEVEL vocabulary of 512 ids).

1. GuidedDecodingParams is checked on construction: a bad schema / regex / EBNF / choice raises a ValueError that
   names the field, a dict of fields goes through the same checks, and the struct survives msgspec (the wire).
2. A GrammarState's mask after any prefix equals a fresh matcher's after the same prefix, whatever order the
   prefixes come in (rollback to the common prefix, then accept): the mask is a function of the prefix.
3. checkpoint / restore put the matcher back after a step explored drafts (the transaction's part).
4. guide_proposals: a chain is cut at the first drafted token the grammar forbids, and before a drafted EOS (the
   grammar allows nothing after it); a tree loses the forbidden node and its subtree, renumbered, draft_probs
   following, and the accepted nodes map back to the proposer's numbering; rows without a grammar are untouched;
   every kept position's mask is a fresh matcher's at that position's drafted prefix.
5. GrammarMasks.apply masks forbidden tokens with MASKED and marks positions left with no token.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from specdec.datamodel.sampling_params import GuidedDecodingParams as G, SamplingParams
from specdec.datamodel.sequence import SequenceData
from specdec.engine.tiny import tiny_tokenizer
from specdec.interfaces import SpeculativeProposals, Verdict
from specdec.sampling.guided import GrammarCompiler, guide_proposals, unpack_bitmask
from specdec.sampling.logits_process import MASKED

V, EOS = 512, 2


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, V, [EOS])


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def fresh_mask(compiler, params: G, prefix: list[int]) -> torch.Tensor:  # [V] bool
    """The reference: a new matcher walked from the start along ``prefix``."""
    import xgrammar as xgr

    m = xgr.GrammarMatcher(compiler.compile(params))
    for t in prefix:
        assert m.accept_token(t), f"{t} is not allowed after {prefix}"
    if m.is_terminated():
        return torch.zeros(V, dtype=torch.bool)
    bm = xgr.allocate_token_bitmask(1, V)
    m.fill_next_token_bitmask(bm)
    return unpack_bitmask(bm, V)[0]


# ------------------------------------------------------------------ 1. the params
@pytest.mark.parametrize("field, value, says", [
    ("regex", "(ab", "parenthesis"),
    ("json", {"type": "objec"}, "objec"),
    ("json", "{not json", "not JSON"),
    ("grammar", "root ::= ", "EBNF"),
    ("choice", [], "non-empty"),
    ("choice", ["a", ""], "non-empty"),
])
def test_a_bad_grammar_is_refused_naming_the_field(field, value, says):
    with pytest.raises(ValueError, match=rf"GuidedDecodingParams\.{field}=.*{says}"):
        G(**{field: value})
    with pytest.raises(ValueError, match=rf"SamplingParams\.guided_decoding: GuidedDecodingParams\.{field}="):
        SamplingParams(guided_decoding={field: value})  # a dict of fields (JSON) goes through the same checks


def test_exactly_one_kind():
    with pytest.raises(ValueError, match="set exactly one of json, regex, choice, grammar, json_object"):
        G()
    with pytest.raises(ValueError, match=r"\['regex', 'choice'\] set"):
        G(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="unknown field `regexp`"):
        SamplingParams(guided_decoding={"regexp": "a"})
    with pytest.raises(TypeError, match="SamplingParams.guided_decoding='a' is invalid"):
        SamplingParams(guided_decoding="a")


@pytest.mark.parametrize("g", [G(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
                               G(json='{"type": "array", "items": {"type": "string"}}', disable_any_whitespace=True),
                               G(regex=r"\d{3}"), G(choice=['a"b', "c\\d", "é"]), G(grammar='root ::= "x" | "y"'),
                               G(json_object=True)])
def test_good_grammars_parse_and_travel(g):
    sp = SamplingParams(guided_decoding=g)
    assert sp.guided_decoding.kind in ("json", "regex", "choice", "grammar", "json_object")
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(sp), type=SamplingParams)  # the v1 engine core's wire
    assert back.guided_decoding == g and back.clone().guided_decoding == g


def test_choice_escapes(tok, compiler):
    g = G(choice=['a"b', "c\\d"])
    for text in ('a"b', "c\\d"):
        t = ids(tok, text)
        assert bool(fresh_mask(compiler, g, t)[EOS]), f"{text!r} is a complete choice"
    assert not bool(fresh_mask(compiler, g, ids(tok, "a"))[ids(tok, "\\")[0]])


def test_unpack_bitmask_matches_shifts():
    g = torch.Generator().manual_seed(0)
    bm = torch.randint(-2**31, 2**31 - 1, (3, 5, 16), generator=g, dtype=torch.int64).to(torch.int32)
    ref = ((bm.unsqueeze(-1).to(torch.int64) >> torch.arange(32)) & 1).bool().reshape(3, 5, 512)[..., :500]
    assert torch.equal(unpack_bitmask(bm, 500), ref)


# ------------------------------------------------------------------ 2-3. the state
JSON = G(json={"type": "object", "required": ["k", "n"],
               "properties": {"k": {"type": "string", "enum": ["ab", "ac"]}, "n": {"type": "integer"}}},
         disable_any_whitespace=True)


def test_the_mask_is_a_function_of_the_prefix(tok, compiler):
    text = ids(tok, '{"k": "ac", "n": 42}') + [EOS]
    state = compiler.state(JSON)
    bm = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
    order = [5, 9, 2, 2, 14, 0, 7, len(text) - 1, 3, len(text), 11, 1]  # forwards, backwards, repeated
    for n in order:
        assert state.fill(text[:n], bm, 0)
        assert torch.equal(unpack_bitmask(bm, V)[0], fresh_mask(compiler, JSON, text[:n])), n
    assert state.fill(text, bm, 0) and not bool(bm.any()), "after the stop token nothing is allowed"
    bad = text[:7] + ids(tok, "x")  # '{"k": "' then x: not an enum value
    assert not state.fill(bad, bm, 0) and state.tokens == text[:7]


def test_checkpoint_drops_explored_drafts_and_restore_undoes_a_step(tok, compiler):
    out = ids(tok, '{"k": "a')
    state = compiler.state(JSON)
    bm = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
    assert state.fill(out + ids(tok, 'c", "n'), bm, 0)  # last step explored drafts past the output
    n = state.checkpoint(out)
    assert n == len(out) and state.tokens == out
    assert state.fill(out + ids(tok, 'b"'), bm, 0)  # this step: drafts and committed tokens
    state.restore(n)  # the step raised
    assert state.tokens == out
    assert state.fill(out, bm, 0) and torch.equal(unpack_bitmask(bm, V)[0], fresh_mask(compiler, JSON, out))


# ------------------------------------------------------------------ 4-5. speculative steps
def seq(tok, prompt: str, out: list[int]) -> SequenceData:
    return SequenceData.from_seqs(ids(tok, prompt), out)


def test_a_chain_is_cut_at_the_first_forbidden_draft(tok, compiler):
    g = G(regex=r"[a-c]+x")
    out = ids(tok, "ab")
    drafts = [ids(tok, "c")[0], ids(tok, "x")[0], EOS, ids(tok, "a")[0],  # row 0: c x EOS a -> c x (EOS ends it)
              ids(tok, "a")[0], ids(tok, "z")[0], ids(tok, "a")[0], ids(tok, "b")[0]]  # row 1: a z.. -> a
    p = SpeculativeProposals.chain(torch.tensor(drafts).view(2, 4), None, torch.tensor([4, 4]))
    plain = SpeculativeProposals.chain(torch.tensor(drafts[:4]).view(1, 4), None, torch.tensor([4]))
    states = [compiler.state(g), compiler.state(g), None]
    both = SpeculativeProposals.chain(torch.cat([p.token_ids, plain.token_ids]), None, torch.tensor([4, 4, 4]))
    got, masks = guide_proposals(both, states, [seq(tok, "p", out)] * 3, V)
    assert got.num_nodes.tolist() == [2, 1, 4], "cut before the EOS draft, at the forbidden z, untouched"
    assert got.token_ids[0, :2].tolist() == drafts[:2] and got.token_ids[0, 2:].tolist() == [-1, -1]
    assert got.is_chain and masks.rows == [0, 1]
    for r, n in ((0, 2), (1, 1)):  # every kept position: a fresh matcher's mask at its drafted prefix
        for j in range(n + 1):
            prefix = out + got.token_ids[r, :j].tolist()
            assert torch.equal(masks.allowed[r, j], fresh_mask(compiler, g, prefix)), (r, j)
    assert masks.proposer_nodes(0, [0, 1]) == [0, 1] and masks.proposer_nodes(2, [0, 1, 2]) == [0, 1, 2]


def test_a_tree_loses_the_forbidden_subtree(tok, compiler):
    g = G(regex=r"a[bc]d")
    a, b, c, d, z = (ids(tok, ch)[0] for ch in "abcdz")
    # node: 0 a (root child) | 1 z (root child, forbidden) | 2 b (of 0) | 3 d (of 1: under a forbidden node)
    #       4 z (of 0, forbidden) | 5 d (of 2) | 6 c (of 0)
    tokens = torch.tensor([[a, z, b, d, z, d, c]])
    parents = torch.tensor([[-1, -1, 0, 1, 0, 2, 0]])
    q = torch.rand(1, 7, V)
    p = SpeculativeProposals(tokens, parents, torch.tensor([7]), q, noise_width=8)
    got, masks = guide_proposals(p, [compiler.state(g)], [seq(tok, "p", [])], V)
    kept = [0, 2, 5, 6]
    assert masks.nodes == [kept] and got.num_nodes.tolist() == [4]
    assert got.token_ids[0].tolist() == [a, b, d, c, -1, -1, -1]
    assert got.parents[0].tolist() == [-1, 0, 1, 0, -1, -1, -1]
    assert torch.equal(got.draft_probs[0, :4], q[0, kept]) and not got.draft_probs[0, 4:].any()
    assert got.noise_width == 8
    assert masks.proposer_nodes(0, [0, 1, 2]) == [0, 2, 5] and masks.proposer_nodes(0, [3]) == [6]
    for j, prefix in enumerate([[], [a], [a, b], [a, b, d], [a, c]]):
        assert torch.equal(masks.allowed[0, j], fresh_mask(compiler, g, prefix)), j


def test_apply_masks_and_marks_empty_positions(tok, compiler):
    g = G(regex="ab")
    a = ids(tok, "a")[0]
    p = SpeculativeProposals.chain(torch.tensor([[a], [a]]), None, torch.tensor([1, 1]))
    _, masks = guide_proposals(p, [None, compiler.state(g)], [seq(tok, "p", [])] * 2, V)
    logits = torch.randn(2, 2, V)
    out = masks.apply(logits)
    assert torch.equal(out[0], logits[0]), "a row without a grammar is untouched"
    assert (out[1, 0] > MASKED).nonzero().flatten().tolist() == [a]
    assert not masks.dead.any()
    logits[1, 1, ids(tok, "b")[0]] = MASKED  # a processor masked the one token the grammar allows there
    masks.apply(logits)
    assert masks.dead[0].tolist() == [False, True]
    accepted = Verdict(path=torch.tensor([[0, -1], [0, 1]]), out=torch.tensor([[a, -1], [a, 7]]))
    err = masks.error(1, accepted, "r1")
    assert err is not None and "allows no next token" in err and "other processors" in err
    assert masks.error(0, accepted, "r0") is None
    rejected = Verdict(path=torch.tensor([[0, -1], [0, -1]]), out=torch.tensor([[a, -1], [a, -1]]))
    assert masks.error(1, rejected, "r1") is None, "the final token comes from the root, which allows 'a'"
