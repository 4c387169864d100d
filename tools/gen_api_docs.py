"""Writes docs/api.md, the API reference, from the docstrings of ringflex's PUBLIC API.

The public API is what ``ringflex.__all__`` exports (each name documented where it is defined,
found by following the package's imports), and the public names of ``ringflex.mods``,
``ringflex.training`` and ``ringflex.integrations.hf`` (a module's ``__all__`` where it has one,
else its names without a leading underscore). Everything else is internal. The sources are read
with ``ast`` (nothing is imported), so the reference is the same whatever optional packages are
installed. Run it after changing a public signature or docstring:

    python -m tools.gen_api_docs [--out docs/api.md]
"""
import argparse
import ast
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "ringflex"
MODULES = ["ringflex.mods", "ringflex.training", "ringflex.integrations.hf"]  # public beside ringflex.__all__


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


def _package_of(module: str) -> str:
    return module if _source(module).name == "__init__.py" else module.rpartition(".")[0]


def _imported_from(module: str, node: ast.ImportFrom) -> str:
    """The absolute name of the module an ``ImportFrom`` of ``module`` reads."""
    if not node.level:
        return node.module
    base = _package_of(module).split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_module(module: str) -> bool:
    return module.split(".")[0] == PACKAGE and _source(module).exists()


def _definition(module: str, name: str):
    """Where ``name`` of ``module`` is defined: (module, its ast node), (submodule name, None)
    for a module, or (outside module, None) for a name imported from outside the package."""
    for node in ast.parse(_source(module).read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return module, node
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return module, node
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    source = _imported_from(module, node)
                    if _is_module(f"{source}.{alias.name}"):
                        return f"{source}.{alias.name}", None
                    return _definition(source, alias.name) if _is_module(source) else (source, None)
    raise LookupError(f"{module} has no {name}")


def _entry(module: str, node) -> list:
    if isinstance(node, ast.FunctionDef):
        return _function(node)
    if isinstance(node, ast.ClassDef):
        return _class(node)
    return [f"### `{ast.unparse(node)}`", ""]  # a constant


def _anchor(module: str) -> str:
    return "#" + module.replace(".", "")


def _top_level() -> list:
    """The package: what it exports, each name documented where it is defined."""
    tree = ast.parse(_source(PACKAGE).read_text())
    lines = [f"## `{PACKAGE}`", ""] + ([_doc(tree), ""] if _doc(tree) else [])
    found = [(name, *_definition(PACKAGE, name)) for name in _exports(tree) or []]
    lines += ["| name | what |", "| --- | --- |"]
    for name, where, node in found:
        what = f"module, [below]({_anchor(where)})" if node is None and where in MODULES else \
            f"`{where}.{name}`" if node is None else f"`{ast.unparse(node)}`" if isinstance(node, ast.Assign) \
            else _doc(node).split("\n\n")[0].replace("\n", " ")
        lines.append(f"| `{name}` | {what.replace('|', '&#124;')} |")
    lines.append("")
    for name, where, node in found:
        if node is not None and not isinstance(node, ast.Assign):
            lines += _entry(where, node)
    return lines


def document(module: str) -> list:
    """A public module: its docstring and its public names (``__all__`` where it has one)."""
    tree = ast.parse(_source(module).read_text())
    lines = [f"## `{module}`", ""]
    lines += [_doc(tree), ""] if _doc(tree) else []
    exported = _exports(tree)
    if exported is not None:
        for name in exported:
            where, node = _definition(module, name)
            lines += _entry(where, node) if node is not None else [f"### `{name}`", "", f"`{where}.{name}`", ""]
        return lines
    outside = [f"`{alias.asname or alias.name}` (`{_imported_from(module, node)}`)" for node in tree.body
               if isinstance(node, ast.ImportFrom) and not _is_module(_imported_from(module, node))
               and _imported_from(module, node).split(".")[0] != "__future__"
               for alias in node.names if _public(alias.asname or alias.name)
               and (alias.asname or alias.name) not in ("annotations",) and _reexported(module, node)]
    for node in tree.body:
        name = getattr(node, "name", None)
        if name is not None and _public(name) and isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            lines += _entry(module, node)
    if outside:
        lines += ["Also exported, from torch: " + ", ".join(outside) + ".", ""]
    return lines


def _reexported(module: str, node: ast.ImportFrom) -> bool:
    """Whether an import from outside the package is marked as a re-export (``# noqa: F401``)."""
    line = _source(module).read_text().splitlines()[node.lineno - 1]
    return "re-export" in line


def render() -> str:
    lines = ["# ringflex API reference", "",
             "Generated from the docstrings by `tools/gen_api_docs.py`; edit the docstrings, not this file.", "",
             f"The public API: the names `{PACKAGE}` exports and the modules below; every other module of the "
             "package is internal and may change.", "",
             "Modules: " + ", ".join(f"[`{m}`]({_anchor(m)})" for m in [PACKAGE] + MODULES), ""]
    lines += _top_level()
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
