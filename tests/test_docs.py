"""The docs name the tests that back their claims as ``tests/<file>.py::<test>``
(a parametrized case as ``<test>[id]``): each must exist, so renaming or removing a
test breaks this check instead of leaving a claim that nothing checks."""

from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
REFERENCE = re.compile(r"(tests/[\w/]+\.py)::(\w+)(\[[^\]\s`]*\])?")


def references() -> dict[tuple[str, str], list[str]]:
    """(test file, test name) -> the docs in docs/*.md that name it."""
    found: dict[tuple[str, str], list[str]] = {}
    for name in sorted(os.listdir(DOCS)):
        if name.endswith(".md"):
            with open(os.path.join(DOCS, name), encoding="utf-8") as f:
                for m in REFERENCE.finditer(f.read()):
                    docs = found.setdefault((m.group(1), m.group(2)), [])
                    if name not in docs:
                        docs.append(name)
    return found


def functions_of(path: str) -> set[str]:
    """The names of the functions defined at the top level of ``path``."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_the_docs_name_tests():
    """Sabotage: a pattern that matches nothing: no reference is found."""
    docs = {doc for names in references().values() for doc in names}
    assert {"reliability.md", "security.md"} <= docs, docs


@pytest.mark.parametrize("path,name,docs", [pytest.param(path, name, docs, id=f"{path}::{name}")
                                            for (path, name), docs in references().items()])
def test_every_test_the_docs_name_exists(path, name, docs):
    """Sabotage: rename a test a doc names (or name one that is not there): its
    reference fails here."""
    assert os.path.isfile(os.path.join(ROOT, path)), f"{docs} name {path}, which does not exist"
    assert name in functions_of(path), f"{docs} name {path}::{name}, which {path} does not define"
