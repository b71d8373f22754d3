"""experiments/bench/guided.py and its schema set data/guided/schemas.jsonl (issue #47).

1. The set: 50 rows of six shapes, unique names; each schema is valid JSON Schema and compiles in xgrammar; each
   is bounded so that its object fits in 128 tokens (data/guided/README.md: strings bounded, arrays with maxItems,
   at most 4 properties per object).
2. The script on the tiny model (2 schemas, 16 tokens, plain and ngram): the table and the JSON report are
   written, n-gram's tokens equal plain's. Its outputs are cut at 16 tokens (a random model), so nothing parses:
   the figures for experiments/LOG.md come from SmolLM2, not from here.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.bench.guided import SCHEMAS, load_rows

ROOT = Path(__file__).resolve().parents[2]
ROWS = load_rows(SCHEMAS)
SHAPES = {"flat": 10, "enum": 10, "number": 7, "pattern": 8, "array": 7, "nested": 8}  # README's table


def test_fifty_rows_of_six_shapes():
    assert len(ROWS) == 50
    assert len({r["name"] for r in ROWS}) == 50
    assert {s: sum(r["shape"] == s for r in ROWS) for s in SHAPES} == SHAPES
    assert all(r["task"].strip() for r in ROWS)


@pytest.mark.parametrize("row", ROWS, ids=[r["name"] for r in ROWS])
def test_each_schema_is_valid_json_schema(row):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validators.validator_for(row["schema"]).check_schema(row["schema"])


def test_each_schema_compiles_in_xgrammar():
    from specdec.datamodel.sampling_params import GuidedDecodingParams
    from specdec.engine.tiny import tiny_tokenizer
    from specdec.sampling.guided import GrammarCompiler

    tok = tiny_tokenizer()  # byte-level: every grammar's text can be spelled
    compiler = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    for r in ROWS:  # raises a ValueError naming the field if one does not compile
        compiler.state(GuidedDecodingParams(json=r["schema"], disable_any_whitespace=True))


def _unbounded(schema: dict, path: str) -> list[str]:
    types = schema.get("type")
    types = types if isinstance(types, list) else [types]
    bad = []
    pattern = schema.get("pattern", "")
    if "string" in types and not ("enum" in schema or "maxLength" in schema
                                  or (pattern.startswith("^") and pattern.endswith("$")
                                      and not re.search(r"[+*]|\{\d+,\}", pattern))):
        bad.append(f"{path}: a string without enum, maxLength or a bounded anchored pattern")
    if "array" in types and "maxItems" not in schema:
        bad.append(f"{path}: an array without maxItems")
    if len(schema.get("properties", {})) > 4:
        bad.append(f"{path}: more than 4 properties")
    for k, v in schema.get("properties", {}).items():
        bad += _unbounded(v, f"{path}.{k}")
    if "items" in schema:
        bad += _unbounded(schema["items"], f"{path}[]")
    return bad


def test_each_schema_is_bounded_to_fit_128_tokens():
    assert [b for r in ROWS for b in _unbounded(r["schema"], r["name"])] == []


def test_the_bench_runs_and_speculation_changes_nothing(tmp_path):
    out = tmp_path / "guided.json"
    r = subprocess.run([sys.executable, "-m", "experiments.bench.guided", "--model", "tiny-random-llama", "--limit", "2",
                        "--configs", "plain,ngram", "--max-tokens", "16", "--threads", "1", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| plain |" in r.stdout and "| ngram |" in r.stdout and "mask cost per token" in r.stdout
    report = json.loads(out.read_text())
    assert set(report["configs"]) == {"plain", "ngram"}
    ngram = report["configs"]["ngram"]
    assert ngram["equal_plain"] == "2/2"
    assert ngram["tokens"] == report["configs"]["plain"]["tokens"] > 0
    assert ngram["grammar_calls"] > 0 and ngram["grammar_us_per_token"] > 0
    assert [s["name"] for s in report["schemas"]] == [r["name"] for r in ROWS[:2]]
    assert all(s["ngram"]["equal_plain"] for s in report["schemas"])
