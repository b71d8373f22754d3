"""Prompt sets for experiments: Spec-Bench (vendored) and plain jsonl files. No model, no tokenizer."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

import msgspec

SPEC_BENCH_CATEGORIES = (
    "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",  # MT-bench
    "translation", "summarization", "qa", "math_reasoning", "rag",
)
MT_BENCH_CATEGORIES = SPEC_BENCH_CATEGORIES[:8]
# the rows of Spec-Bench's report (evaluation/speed.py): MT-bench's 8 categories pooled, then one task each
SPEC_BENCH_TASKS = {"mt_bench": MT_BENCH_CATEGORIES, **{c: (c,) for c in SPEC_BENCH_CATEGORIES[8:]}}


class Prompt(msgspec.Struct, kw_only=True):
    question_id: str  # stable id from the source file
    category: str  # Spec-Bench category, or "default" for plain jsonl
    turns: list[str]  # user turns; MT-bench questions have two


def spec_bench_path() -> Path:
    return Path(str(files("specdec").joinpath("assets", "spec_bench_question.jsonl")))


def load_spec_bench(
    categories: list[str] | str | None = None,
    per_category: int | None = None,
    path: str | None = None,
) -> list[Prompt]:
    """Spec-Bench questions, in file order, keeping at most ``per_category`` of each chosen category.

    ``categories``: None/'all' = all 13, 'mt_bench' = MT-bench's 8, or a list of names.
    """
    if categories is None or categories == "all":
        wanted = list(SPEC_BENCH_CATEGORIES)
    elif categories == "mt_bench":
        wanted = list(MT_BENCH_CATEGORIES)
    else:
        wanted = [categories] if isinstance(categories, str) else list(categories)
    unknown = [c for c in wanted if c not in SPEC_BENCH_CATEGORIES]
    if unknown:
        raise ValueError(f"unknown Spec-Bench categories {unknown}; choose from {list(SPEC_BENCH_CATEGORIES)}, "
                         "'all' or 'mt_bench'")
    src = Path(path) if path else spec_bench_path()
    if not src.exists():
        raise FileNotFoundError(f"Spec-Bench file {src} not found; set dataset.path to a question.jsonl")
    taken: dict[str, int] = {}
    out = []
    for line in src.read_text().splitlines():
        row = json.loads(line)
        cat = row["category"]
        if cat not in wanted or (per_category is not None and taken.get(cat, 0) >= per_category):
            continue
        taken[cat] = taken.get(cat, 0) + 1
        out.append(Prompt(question_id=str(row["question_id"]), category=cat, turns=list(row["turns"])))
    return out


def load_jsonl_prompts(path: str, field: str = "prompt", limit: int | None = None) -> list[Prompt]:
    """A plain jsonl file: one object per line with the prompt text under ``field``."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if limit is not None and len(out) >= limit:
            break
        row = json.loads(line)
        if field not in row:
            raise KeyError(f"{path}:{i + 1} has no field {field!r} (fields: {sorted(row)}); set dataset.field")
        out.append(Prompt(question_id=str(row.get("id", i)), category="default", turns=[row[field]]))
    return out
