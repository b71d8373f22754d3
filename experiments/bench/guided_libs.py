"""Which grammar library for structured outputs (#47): mask cost per token and features, xgrammar vs llguidance.

    python -m experiments.bench.guided_libs [--model smollm2-135m-instruct] [--repeats 5]

For each library and each grammar (a JSON schema, a regex): compile time, then the cost of one token of
guided decoding along a fixed valid output (that output tokenized by the model's tokenizer): fill the
vocabulary bitmask, then accept the token; median over ``--repeats`` passes, per token. Also whether a
matcher can roll back (what speculation needs) and which grammar kinds it takes. The choice and the figures
are in experiments/LOG.md. Knows nothing about models: only the tokenizer is loaded (specdec's loader).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdec.engine.loader import load_tokenizer, model_info

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "email", "tags", "address"],
}
INSTANCE = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@math.com", "tags": ["a", "c"],
                       "address": {"city": "London", "zip": "W1 1AA"}})
REGEX = r"\d{3}-\d{3}-\d{4} \((home|work|mobile)\)"
REGEX_TEXT = "555-123-4567 (mobile)"


def per_token(run, repeats: int, n: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / n


def bench_xgrammar(tok, V: int, ids_json: list[int], ids_regex: list[int], repeats: int) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    out = {"tokenizer_s": time.perf_counter() - t0}
    for name, compile_, ids in (("json", lambda: compiler.compile_json_schema(json.dumps(SCHEMA)), ids_json),
                                ("regex", lambda: compiler.compile_regex(REGEX), ids_regex)):
        t0 = time.perf_counter()
        cg = compile_()
        out[f"{name}_compile_s"] = time.perf_counter() - t0
        mask = xgr.allocate_token_bitmask(1, V)

        def run() -> None:
            m = xgr.GrammarMatcher(cg, max_rollback_tokens=-1)
            for t in ids:
                m.fill_next_token_bitmask(mask)
                assert m.accept_token(t), t
            m.rollback(len(ids))  # speculation's rollback, checked to work

        out[f"{name}_us_per_token"] = 1e6 * per_token(run, repeats, len(ids))
    return out


def bench_llguidance(tok, V: int, ids_json: list[int], ids_regex: list[int], repeats: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=V)
    out = {"tokenizer_s": time.perf_counter() - t0}
    for name, grm, ids in (("json", llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)), ids_json),
                           ("regex", llguidance.LLMatcher.grammar_from_regex(REGEX), ids_regex)):
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(lltok, grm)
        assert not m.is_error(), m.get_error()
        out[f"{name}_compile_s"] = time.perf_counter() - t0
        mask = lt.allocate_token_bitmask(1, V)

        def run() -> None:
            m = llguidance.LLMatcher(lltok, grm)  # llguidance compiles lazily, per matcher: counted here
            for t in ids:
                lt.fill_next_token_bitmask(m, mask, 0)
                assert m.consume_token(t), (t, m.get_error())
            m.rollback(len(ids))

        out[f"{name}_us_per_token"] = 1e6 * per_token(run, repeats, len(ids))
    return out


FEATURES = {
    "xgrammar": "JSON schema, regex, EBNF (GBNF), Lark, builtin JSON, structural tags; rollback(n) with "
                "max_rollback_tokens; traverse_draft_tree (masks a whole draft tree)",
    "llguidance": "JSON schema, regex, Lark (EBNF via gbnf_to_lark), choice via regex/Lark; rollback(n); "
                  "masks computed lazily (Earley parser + token trie, no grammar precompile)",
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    tok = load_tokenizer(args.model)
    V = model_info(args.model).vocab_size
    ids_json = tok(INSTANCE, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids_regex = tok(REGEX_TEXT, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    print(f"model {args.model}: vocab {V}; JSON instance {len(ids_json)} tokens, regex text {len(ids_regex)}")
    for name, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        res = fn(tok, V, ids_json, ids_regex, args.repeats)
        print(name, json.dumps({k: round(v, 4) for k, v in res.items()}))
        print("  features:", FEATURES[name])


if __name__ == "__main__":
    main()
