"""Writes docs/api.md, the API reference, from the docstrings of ringflex's public modules.

It reads the sources with ``ast`` (nothing is imported), so the reference is the same whatever
optional packages are installed. Run it after changing a public signature or docstring:

    python tools/gen_api_docs.py [--out docs/api.md]
"""
import argparse
import ast
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["ringflex", "ringflex.api", "ringflex.module", "ringflex.varlen", "ringflex.training", "ringflex.mods",
           "ringflex.plan.layout", "ringflex.parallel.shard", "ringflex.integrations.hf", "ringflex.progress",
           "ringflex.env"]


def _source(module: str) -> Path:
    path = ROOT.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _doc(node) -> str:
    return inspect.cleandoc(ast.get_docstring(node) or "")


def _signature(fn, drop_self=False) -> str:
    args = fn.args
    if drop_self and (args.posonlyargs or args.args):
        args = ast.arguments(posonlyargs=args.posonlyargs[1:] if args.posonlyargs else [],
                             args=args.args[1:] if not args.posonlyargs else args.args, vararg=args.vararg,
                             kwonlyargs=args.kwonlyargs, kw_defaults=args.kw_defaults, kwarg=args.kwarg,
                             defaults=args.defaults)
    returns = f" -> {ast.unparse(fn.returns)}" if fn.returns is not None else ""
    return f"({ast.unparse(args)}){returns}"


def _public(name: str) -> bool:
    return not name.startswith("_")


def _exports(tree):
    """The names in ``__all__``, or None."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return [ast.literal_eval(e) for e in node.value.elts]
    return None


def _function(fn, heading="###", prefix="", drop_self=False) -> list:
    kind = "".join(f"@{ast.unparse(d)} " for d in fn.decorator_list if ast.unparse(d) in ("classmethod", "property",
                                                                                           "staticmethod"))
    lines = [f"{heading} {kind}`{prefix}{fn.name}{'' if 'property' in kind else _signature(fn, drop_self)}`", ""]
    return lines + ([_doc(fn), ""] if _doc(fn) else [])


def _class(cls) -> list:
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    bases = ", ".join(ast.unparse(b) for b in cls.bases)
    lines = [f"### class `{cls.name}{_signature(init, drop_self=True) if init else ''}`", ""]
    lines += [f"Bases: `{bases}`", ""] if bases else []
    lines += [_doc(cls), ""] if _doc(cls) else []
    seen = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and _public(node.name) and node.name not in seen:
            seen.add(node.name)  # a property's setter repeats its name
            lines += _function(node, "####", f"{cls.name}.", drop_self="staticmethod" not in ast.unparse(node))
    return lines


def _top_level(module: str, tree) -> list:
    """The package: what it exports, and from where."""
    where = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                source = f"ringflex.{node.module}" if node.module else f"ringflex.{alias.name}"
                where[alias.asname or alias.name] = source.replace("..", ".")
    lines = ["| name | defined in |", "| --- | --- |"]
    lines += [f"| `{name}` | `{where.get(name, module)}` |" for name in _exports(tree) or []]
    return lines + [""]


def document(module: str) -> list:
    tree = ast.parse(_source(module).read_text())
    lines = [f"## `{module}`", ""]
    lines += [_doc(tree), ""] if _doc(tree) else []
    if module == "ringflex":
        return lines + _top_level(module, tree)
    exported = _exports(tree)
    for node in tree.body:
        name = getattr(node, "name", None)
        if name is None or not (name in exported if exported is not None else _public(name)):
            continue
        if isinstance(node, ast.FunctionDef):
            lines += _function(node)
        elif isinstance(node, ast.ClassDef):
            lines += _class(node)
    return lines


def render() -> str:
    lines = ["# ringflex API reference", "",
             "Generated from the docstrings by `tools/gen_api_docs.py`; edit the docstrings, not this file.", "",
             "Modules: " + ", ".join(f"[`{m}`](#{m.replace('.', '')})" for m in MODULES), ""]
    for module in MODULES:
        lines += document(module)
    return "\n".join(lines).rstrip() + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "api.md"))
    args = parser.parse_args()
    Path(args.out).write_text(render())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
