"""Prompts built from text that installed packages ship under permissive licences: the Python standard
library's source and docstrings and its language-reference topics (``pydoc_data.topics``, PSF-2.0), and the
docstrings of numpy, scipy, sympy, networkx, requests, click and transformers (BSD / Apache-2.0; each
licence is read from the package's metadata and recorded per prompt).

Files are parsed with ``ast``, never imported (no side effects; the same files give the same prompts).
It knows nothing about the target or the tokenizer. Categories: coding, extraction, summarization, rag,
translation.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import random
import re
import sys
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

from experiments.distill.templates import TRANS_LANGS, TRANS_T

# (distribution, import directory) pairs whose docstrings are read; stdlib is handled apart.
PACKAGES = [("numpy", "numpy"), ("scipy", "scipy"), ("sympy", "sympy"), ("networkx", "networkx"),
            ("requests", "requests"), ("click", "click"), ("transformers", "transformers")]
# at most this many files per package, a seeded sample: transformers alone would outweigh the rest (its
# per-model files repeat each other) and parsing every file takes minutes
_MAX_FILES = 200
# stdlib parts skipped: tests, GUI/IDE code, vendored or generated files
_STDLIB_SKIP = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "site-packages", "ensurepip",
                "pydoc_data", "encodings", "__pycache__", "config-3", "venv", "distutils", "unittest"}
_MAX_SRC_CHARS = 2400  # ~600 tokens: a function to explain fits beside its answer
_MAX_DOC_CHARS = 4000  # ~1000 tokens: the long-context RAG / summarisation passages


@dataclass
class Doc:
    source: str  # "stdlib" | distribution name
    licence: str
    module: str
    name: str  # qualified name, or "" for a module docstring
    signature: str
    doc: str  # cleaned docstring
    code: str  # source of the function ("" for modules / classes)


def licence_of(dist: str) -> str:
    m = md.metadata(dist)
    lic = m.get("License-Expression") or ""
    if not lic or len(lic) > 60:
        classifiers = [c.split("::")[-1].strip() for c in m.get_all("Classifier") or [] if c.startswith("License")]
        lic = ", ".join(classifiers) or (m.get("License") or "")[:60]
    return lic.strip()


def _files(root: Path, skip: set[str]) -> list[Path]:
    return sorted(p for p in root.rglob("*.py")
                  if not any(part in skip or part.startswith("test") for part in p.relative_to(root).parts[:-1])
                  and not p.name.startswith("test"))


def _signature(fn: ast.FunctionDef) -> str:
    try:
        return f"({ast.unparse(fn.args)})"
    except Exception:  # noqa: BLE001 - an exotic default value: no signature
        return "(...)"


def _clean(doc: str) -> str:
    doc = re.sub(r"\n{3,}", "\n\n", doc.strip())
    return doc if len(doc) <= _MAX_DOC_CHARS else doc[:_MAX_DOC_CHARS].rsplit("\n", 1)[0]


def _docs_in(path: Path, module: str, source: str, licence: str) -> list[Doc]:
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    out = []
    mdoc = ast.get_docstring(tree)
    if mdoc and len(mdoc) > 200:
        out.append(Doc(source, licence, module, "", "", _clean(mdoc), ""))
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 60:
            continue
        code = ""
        if isinstance(node, ast.FunctionDef):
            code = textwrap.dedent(" " * node.col_offset + (ast.get_source_segment(text, node) or ""))
            if len(code) > _MAX_SRC_CHARS or code.count("\n") < 6:
                code = ""
        sig = _signature(node) if isinstance(node, ast.FunctionDef) else ""
        out.append(Doc(source, licence, module, node.name, sig, _clean(doc), code))
    return out


def collect_docs(max_files: int = _MAX_FILES, max_stdlib_files: int | None = None) -> list[Doc]:
    """Every public function/class/module docstring of the stdlib and PACKAGES (a seeded sample of
    ``max_files`` files each), in a fixed order."""
    docs: list[Doc] = []
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lic = f"PSF-2.0 (Python {sys.version.split()[0]} standard library)"
    files = _files(stdlib, _STDLIB_SKIP)
    if max_stdlib_files is not None:
        files = sorted(random.Random("stdlib").sample(files, min(max_stdlib_files, len(files))))
    for p in files:
        docs += _docs_in(p, ".".join(p.relative_to(stdlib).with_suffix("").parts), "stdlib", lic)
    for dist, pkg in PACKAGES:
        try:
            root = Path(md.distribution(dist).locate_file(pkg))
            lic = f"{licence_of(dist)} ({dist} {md.version(dist)})"
        except md.PackageNotFoundError:
            continue
        if not root.is_dir():
            continue
        files = _files(root, {"tests", "test", "testing", "_vendor", "externals"})
        files = sorted(random.Random(dist).sample(files, min(max_files, len(files))))
        for p in files:
            docs += _docs_in(p, ".".join((pkg,) + p.relative_to(root).with_suffix("").parts), dist, lic)
    return docs


def reference_topics() -> list[tuple[str, str]]:
    """(topic, text) sections of the Python language reference that pydoc ships (PSF-2.0)."""
    from pydoc_data.topics import topics

    return [(k, _clean(v)) for k, v in sorted(topics.items()) if len(v) > 400]


def _first_paragraph(doc: str) -> str:
    return doc.split("\n\n")[0].replace("\n", " ").strip()


def _first_sentence(doc: str) -> str | None:
    s = re.split(r"(?<=[.!?])\s", _first_paragraph(doc))[0]
    words = s.split()
    if not 6 <= len(words) <= 30 or re.search(r"[`_(){}\[\]=<>*|:]", s) or not s[0].isupper():
        return None
    return s


CODING = [
    "Explain what this Python function does:\n\n```python\n{code}\n```",
    "Write unit tests with pytest for this function:\n\n```python\n{code}\n```",
    "Review this code and suggest improvements:\n\n```python\n{code}\n```",
    "Rewrite this function in a simpler way, keeping its behaviour:\n\n```python\n{code}\n```",
    "Add comments to this code that explain each step:\n\n```python\n{code}\n```",
    "What are the edge cases this function handles, and any it misses?\n\n```python\n{code}\n```",
]
CODING_FROM_DOC = [
    "Write a Python function `{name}{sig}` that does the following:\n\n{para}",
    "Implement `{name}{sig}` in Python. Its documentation says:\n\n{para}",
    "Give an example of how to call `{module}.{name}` and explain the result. Documentation:\n\n{doc}",
]
EXTRACT = [
    "From the documentation below, list every parameter with its type and meaning as a JSON list of "
    "objects with the keys name, type and description.\n\n{doc}",
    "Extract the return value and the exceptions described in this documentation:\n\n{doc}",
    "List all the function, class or module names mentioned in this text:\n\n{doc}",
    "Turn this documentation into a table with the columns Parameter, Type, Default:\n\n{doc}",
]
SUMMARIZE = [
    "Summarize the following documentation in two sentences:\n\n{doc}",
    "Write a one-paragraph summary of this text for a beginner:\n\n{doc}",
    "TL;DR of the following:\n\n{doc}", "Give the three most important points of this text as bullet points:\n\n{doc}",
]
RAG = [
    "Answer the question using only the passage below.\n\nPassage:\n{doc}\n\nQuestion: What does `{name}` do?",
    "Read the documentation and answer.\n\n{doc}\n\nQuestion: When would someone use `{name}`, and what are its inputs?",
    "Here is a passage from the documentation of `{module}`:\n\n{doc}\n\nBased only on this passage, explain `{name}` "
    "to a new user.",
    "Context:\n{doc}\n\nUsing the context above, is there anything a user of `{name}` should be careful about?",
]
RAG_MULTI = ("Use the documents below to answer the question.\n\n{docs}\n\nQuestion: Which document describes "
             "`{name}`, and what does it say it does?")
RAG_TOPIC = [
    "Read this section of the Python language reference and answer the question.\n\n{doc}\n\nQuestion: "
    "What is the main rule this section defines? Give an example.",
    "Passage:\n{doc}\n\nBased on the passage, explain the topic \"{name}\" in your own words.",
    "{doc}\n\nAccording to the text above, what are the key terms it defines? List them with a short definition each.",
]
SUMMARIZE_TOPIC = "Summarize this section of the Python language reference (topic: {name}):\n\n{doc}"


def doc_prompts(counts: dict[str, int], seed: int = 0, small: bool = False) -> list[tuple[str, str, str, str]]:
    """(category, user message, source, licence) tuples: counts for coding, extraction, summarization, rag,
    translation. ``small``: a few files per package (smoke tests)."""
    rng = random.Random(seed)
    docs = collect_docs(5, 20) if small else collect_docs()
    rng.shuffle(docs)
    funcs = [d for d in docs if d.code]
    with_params = [d for d in docs if d.name and re.search(r"Parameters\n-+|Args:|:param ", d.doc)]
    prose = [d for d in docs if len(d.doc) > 300]
    topics = reference_topics()
    rng.shuffle(topics)
    out: list[tuple[str, str, str, str]] = []

    def add(cat, text, d: Doc | None):
        out.append((cat, text, d.source if d else "stdlib", d.licence if d else "PSF-2.0 (pydoc_data.topics)"))

    n = counts.get("coding", 0)
    for i, d in enumerate(funcs[: n * 2 // 3]):
        add("coding", CODING[i % len(CODING)].format(code=d.code), d)
    named = [d for d in docs if d.signature and len(_first_paragraph(d.doc)) > 40]
    for i, d in enumerate(named[: n - n * 2 // 3]):
        add("coding", CODING_FROM_DOC[i % len(CODING_FROM_DOC)].format(
            name=d.name, sig=d.signature, para=_first_paragraph(d.doc), module=d.module, doc=d.doc), d)
    for i, d in enumerate(with_params[: counts.get("extraction", 0)]):
        add("extraction", EXTRACT[i % len(EXTRACT)].format(doc=d.doc), d)
    n = counts.get("summarization", 0)
    for i, (name, text) in enumerate(topics[: n // 5]):
        add("summarization", SUMMARIZE_TOPIC.format(name=name, doc=text), None)
    for i, d in enumerate(prose[-(n - min(n // 5, len(topics))):]):  # the other end of the shuffle than RAG's
        add("summarization", SUMMARIZE[i % len(SUMMARIZE)].format(doc=d.doc), d)
    n = counts.get("rag", 0)
    for i, (name, text) in enumerate(topics[n // 5 and len(topics) // 2:][: n // 10]):
        add("rag", RAG_TOPIC[i % len(RAG_TOPIC)].format(name=name, doc=text), None)
    named_prose = [d for d in prose if d.name]
    n_multi = n // 4
    for i, d in enumerate(named_prose[: n - n // 10 - n_multi]):
        add("rag", RAG[i % len(RAG)].format(doc=d.doc, name=d.name, module=d.module), d)
    short = [d for d in docs if d.name and 150 < len(d.doc) < 1200]
    for i in range(n_multi):
        group = short[3 * i: 3 * i + 3]
        if len(group) < 3:
            break
        target = group[rng.randrange(3)]
        body = "\n\n".join(f"Document {j + 1} ({g.module}):\n{g.doc}" for j, g in enumerate(group))
        add("rag", RAG_MULTI.format(docs=body, name=target.name), target)
    sentences = [(s, d) for d in docs if (s := _first_sentence(d.doc))]
    sentences = list({s: (s, d) for s, d in sentences}.values())
    for i, (s, d) in enumerate(sentences[: counts.get("translation", 0)]):
        add("translation", TRANS_T[i % len(TRANS_T)].format(lang=TRANS_LANGS[rng.randrange(len(TRANS_LANGS))], s=s), d)
    return out
