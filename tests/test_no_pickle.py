"""Nothing in the packages that read sockets can unpickle, unmarshal, eval or exec (DESIGN rules):
a static check over every module of engine/, kvtransfer/ and server/."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}
FILES = sorted(p for pkg in ("engine", "kvtransfer", "server") for p in Path(pkg).rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=str)
def test_no_pickle_marshal_eval_exec(path):
    tree = ast.parse(path.read_text(), str(path))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bad += [a.name for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
            bad.append(node.module)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS:
            bad.append(f"{node.func.id}() at line {node.lineno}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
            kw = {k.arg: k.value for k in node.keywords}
            ok = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
            if not ok:
                bad.append(f"torch.load without weights_only=True at line {node.lineno}")
    assert not bad, f"{path}: {bad}"


def test_the_scan_sees_every_package():
    names = {str(p) for p in FILES}
    assert {"server/gateway/app.py", "kvtransfer/wire.py", "engine/core/llm_engine.py"} <= names
