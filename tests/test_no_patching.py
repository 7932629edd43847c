"""Multi-rank runs through explicit seams, checked from the source: no ``__class__`` swaps anywhere,
and engine/parallel replaces no method of another object (the engine calls a model runner,
``engine.core.model_runner`` / ``engine.parallel.rank_runner``; sharding builds parallel modules or
sets the model's documented TP fields), so reading ``model.logits`` or ``type(block.ffn)`` tells
what runs on every rank."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kvtransfer", "server")
# the classes whose methods multi-rank code used to replace on live objects
METHOD_OWNERS = ("engine/model", "engine/core")


def _is_property(decorator: ast.AST) -> bool:
    return (isinstance(decorator, ast.Name) and decorator.id in ("property", "cached_property")) or \
        (isinstance(decorator, ast.Attribute) and decorator.attr == "setter")


def _methods() -> set[str]:
    """Names of the methods of every class in METHOD_OWNERS (dunders and properties aside)."""
    out = set()
    for d in METHOD_OWNERS:
        for p in (ROOT / d).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.ClassDef):
                    out |= {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                            and not f.name.startswith("__") and not any(_is_property(d) for d in f.decorator_list)}
    return out


def _is_function_value(node: ast.AST, local_defs: set[str]) -> bool:
    """A lambda, a ``partial(...)`` / ``MethodType(...)``, or a function defined in the module."""
    if isinstance(node, ast.Lambda):
        return True
    if isinstance(node, ast.Call):
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        return name in ("partial", "MethodType")
    return isinstance(node, ast.Name) and node.id in local_defs


def class_swaps(source: str) -> list[int]:
    """Lines that assign ``x.__class__`` (or ``setattr(x, "__class__", ...)``)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(el, ast.Attribute) and el.attr == "__class__":
                        out.append(node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr" and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) and node.args[1].value == "__class__":
            out.append(node.lineno)
    return out


def method_patches(source: str, methods: set[str]) -> list[str]:
    """``line: target`` of each assignment onto another object's attribute (not ``self.x``) that
    names one of ``methods`` or stores a function (lambda, partial, a local def)."""
    tree = ast.parse(source)
    local_defs = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        for t in node.targets:
            pairs = list(zip(t.elts, node.value.elts)) if isinstance(t, ast.Tuple) and isinstance(
                node.value, ast.Tuple) else [(el, node.value) for el in (t.elts if isinstance(t, ast.Tuple) else [t])]
            for el, value in pairs:
                if not isinstance(el, ast.Attribute) or (isinstance(el.value, ast.Name) and el.value.id == "self"):
                    continue
                if el.attr in methods or _is_function_value(value, local_defs):
                    out.append(f"{node.lineno}: {ast.unparse(el)}")
    return out


def test_no_module_swaps_a_class():
    bad = {str(p.relative_to(ROOT)): lines for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
           if (lines := class_swaps(p.read_text()))}
    assert bad == {}


def test_parallel_replaces_no_method_of_another_object():
    methods = _methods()
    assert {"forward_batch", "logits", "embed_tokens", "out_proj", "allocate", "free", "load_state"} <= methods
    bad = {str(p.relative_to(ROOT)): found for p in sorted((ROOT / "engine/parallel").rglob("*.py"))
           if (found := method_patches(p.read_text(), methods))}
    assert bad == {}


def test_the_checks_see_the_old_patterns():
    src = ("def f(x):\n    pass\n"
           "moe.__class__ = ParallelMoE\n"
           "setattr(mlp, '__class__', ParallelSharedMLP)\n"
           "model.logits = partial(f, model)\n"
           "cache.allocate, cache.free = alloc, free_\n"
           "model.forward_batch = lambda *a: None\n"
           "hook.cb = f\n"
           "self.fn = f\n"
           "blk.ffn = ParallelMoE(blk.ffn)\n")
    assert class_swaps(src) == [3, 4]
    assert method_patches(src, {"logits", "allocate", "free", "forward_batch"}) == [
        "5: model.logits", "6: cache.allocate", "6: cache.free", "7: model.forward_batch", "8: hook.cb"]
