"""The docs name the tests that back their claims as ``tests/<file>.py::<test>``
(a parametrized case as ``<test>[id]``): each must exist, so renaming or removing a
test breaks this check instead of leaving a claim that nothing checks."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
REFERENCE = re.compile(r"(tests/[\w/]+\.py)::(\w+)(\[[^\]\s`]*\])?")


def named() -> list[tuple[str, re.Match]]:
    """(doc, reference) for every ``tests/<file>.py::<test>`` in docs/*.md."""
    out = []
    for name in sorted(os.listdir(DOCS)):
        if name.endswith(".md"):
            with open(os.path.join(DOCS, name), encoding="utf-8") as f:
                out += [(name, m) for m in REFERENCE.finditer(f.read())]
    return out


def references() -> dict[tuple[str, str], list[str]]:
    """(test file, test name) -> the docs in docs/*.md that name it."""
    found: dict[tuple[str, str], list[str]] = {}
    for name, m in named():
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


def cases() -> dict[tuple[str, str, str], list[str]]:
    """(test file, test name, case id) -> the docs that name that case; ``a|b``
    (``a\\|b`` in a table) names two, ``...`` any."""
    found: dict[tuple[str, str, str], list[str]] = {}
    for name, m in named():
        for case in (m.group(3) or "[...]")[1:-1].replace("\\", "").split("|"):
            if case != "...":
                found.setdefault((m.group(1), m.group(2), case), []).append(name)
    return found


@pytest.mark.timeout(300)
def test_every_case_the_docs_name_exists():
    """Each ``tests/<file>.py::<test>[id]`` a doc names is a case pytest collects
    (a bare ``[id]`` after it in the text is not read). Sabotage: rename a
    case a doc names (an id of ``test_sigterm_ends_the_demo...``): it fails here.
    Before, the id was read and dropped: only the test's name was checked."""
    named = cases()
    paths = sorted({path for path, _, _ in named})
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          *paths], cwd=ROOT, capture_output=True, text=True, timeout=240)
    collected = {line.strip() for line in out.stdout.splitlines() if "::" in line}
    assert len(collected) > 100, out.stdout[-2000:] + out.stderr[-2000:]
    missing = [f"{path}::{test}[{case}] (in {', '.join(docs)})" for (path, test, case), docs in named.items()
               if f"{path}::{test}[{case}]" not in collected]
    assert not missing, missing


@pytest.mark.timeout(120)
def test_the_readmes_driver_runs_as_written(tmp_path):
    """README's two files, as they stand there, run and give what its comments say.
    Sabotage: the worker class in the driver's own file, as the README once had
    it -> the executor refuses a class defined in ``__main__``."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        section = f.read().split("## A driver", 1)[1]
    blocks = re.findall(r"```python\n# (\w+\.py)[^\n]*\n(.*?)```", section, re.S)
    assert [name for name, _ in blocks] == ["mymodel.py", "driver.py"]
    for name, code in blocks:
        (tmp_path / name).write_text(code)
    with open(tmp_path / "driver.py", "a") as f:
        f.write("print(y, fut.result(timeout=10))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    out = subprocess.run([sys.executable, "driver.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == "6 [8, 8]", out.stdout
