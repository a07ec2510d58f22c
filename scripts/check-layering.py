#!/usr/bin/env python3
"""Checks the layering rules ARCHITECTURE.md states, from the source alone.

- Within each crate, a top-level module imports only modules of a lower layer
  (LAYERS below, highest first). Within one module, files import each other freely,
  except that under the folders of PARENT_FREE no file imports a module it sits in
  (its folder's `mod.rs`, or one above it): a parent lists and runs its children,
  and what they share lives in a file of its own beside them (`detect/view.rs`, not
  `detect/mod.rs`).
- No two files import each other in a circle (file-level cycles, any length).
- The pure core crate depends on no I/O crate (its Cargo.toml and its `use` lines).
- The Python client (`clients/python/src/gradflow`): each top-level name of the
  package belongs to a layer (PY_LAYER_OF), and a module imports only modules of its
  own layer or of one PY_MAY_IMPORT lists for it (every import counts: at the top,
  inside a function, under `TYPE_CHECKING`); no two modules import each other in a
  circle.

An import is any `crate::a::b` or `super::x` path in a file's code (comments
stripped), resolved to the file that defines it. Exits non-zero, naming every
violation, or prints a one-line summary.

    python3 scripts/check-layering.py
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Top-level modules of each crate by layer, highest first. A module imports only
# modules in later entries of its crate's list.
LAYERS: dict[str, list[set[str]]] = {
    "server/src": [
        {"main"},
        {"demo"},
        {"startup", "import"},
        {"config"},
        {"app"},
        {"pages", "openapi"},
        {"routes"},
        {"state", "charts"},
        {"metrics", "api_types", "body"},
        {"error"},
        {"ingest", "webhooks", "retention"},
        {"events"},
        {"store"},
    ],
    "core/src": [
        {"run"},
        {"detect"},
        {"columnar", "series"},
        {"model"},
    ],
}

# Folders whose files never import a module they sit in: the whole core, and the
# ingest service (its preparers share `plan.rs`, not `mod.rs`).
PARENT_FREE = {"core/src", "server/src/ingest"}

# Crates the core must never depend on: they do I/O or drawing.
CORE_FORBIDDEN = {
    "tokio",
    "sqlx",
    "axum",
    "hyper",
    "reqwest",
    "plotters",
    "tower",
    "tower-http",
    "tracing-subscriber",
    "mimalloc",
}

# The Python client's layers. Top level: the API the user calls and the CLI (`api`),
# above what runs on the training thread (`capture`), above turning tensors into
# numbers (`measurement`); off the training thread, `delivery` (reporter thread,
# transport, spool, alerts), which knows nothing of capture or measurement and they
# nothing of it; under everything the foundation every layer may import (the wire
# format, errors, logging, settings, private torch APIs). Nothing imports the
# integrations but the package's own lazy attribute (PY_ALLOWED).
PY_PACKAGE = "clients/python/src/gradflow"
PY_LAYER_OF: dict[str, str] = {
    "integrations": "integrations",
    **dict.fromkeys(
        ["__init__", "__main__", "api", "watcher", "options", "check", "report", "steplimit"],
        "api",
    ),
    "capture": "capture",
    "measurement": "measurement",
    "delivery": "delivery",
    **dict.fromkeys(["wire", "errors", "_log", "_env", "_torch_compat"], "foundation"),
}
PY_MAY_IMPORT: dict[str, set[str]] = {
    "integrations": {"api", "foundation"},
    "api": {"capture", "measurement", "delivery", "foundation"},
    "capture": {"measurement", "foundation"},
    "measurement": {"foundation"},
    "delivery": {"foundation"},
    "foundation": set(),
}
# `gradflow.integrations` named after a bare `import gradflow` loads the subpackage.
PY_ALLOWED = {("gradflow", "gradflow.integrations")}

COMMENT = re.compile(r"//[^\n]*")
PATH = re.compile(r"\b(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)+|::\{)")
GROUP = re.compile(r"\b(crate|super)::\{([^}]*)\}", re.DOTALL)


def module_files(src: Path) -> dict[tuple[str, ...], Path]:
    """Module path (`("ingest", "state")`) → file, for every .rs file of a crate."""
    files = {}
    for path in src.rglob("*.rs"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "mod":
            parts.pop()
        if parts in (["lib"],):
            parts = []
        files[tuple(parts)] = path
    return files


def references(text: str, here: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The module paths a file's code names, as absolute paths."""
    code = COMMENT.sub("", text)
    # `super` is the parent of the file's module (for `a/mod.rs`, module `a`: the root).
    parent = here[:-1]
    out: list[tuple[str, ...]] = []

    def absolute(root: str, rest: list[str]) -> tuple[str, ...]:
        base = () if root == "crate" else parent
        return tuple(base) + tuple(rest)

    for m in GROUP.finditer(code):
        for item in m.group(2).split(","):
            name = item.strip().split("::")
            if name and name[0] and name[0] not in ("self",):
                out.append(absolute(m.group(1), [n.strip() for n in name if n.strip()]))
    for m in PATH.finditer(code):
        if m.group(2) == "::{":
            continue
        rest = [p for p in m.group(2).split("::") if p]
        out.append(absolute(m.group(1), rest))
    return out


def resolve(path: tuple[str, ...], files: dict[tuple[str, ...], Path]) -> tuple[str, ...] | None:
    for n in range(len(path), 0, -1):
        if path[:n] in files:
            return path[:n]
    return None


def parent_free(src_dir: str, module: tuple[str, ...]) -> bool:
    """Whether the file of `module` lies under a folder of PARENT_FREE."""
    folder = "/".join((src_dir,) + module)
    return any(folder == d or folder.startswith(d + "/") for d in PARENT_FREE)


def check_crate(src_dir: str, errors: list[str]) -> tuple[int, int]:
    src = ROOT / src_dir
    files = module_files(src)
    layer_of = {m: i for i, layer in enumerate(LAYERS[src_dir]) for m in layer}
    graph: dict[tuple[str, ...], set[tuple[str, ...]]] = {m: set() for m in files}
    for module, path in files.items():
        if not module:
            continue
        text = path.read_text()
        # Unit tests may reach anywhere in their own crate: a file of test helpers
        # (`#![cfg(test)]`), and a file's own test module.
        if "#![cfg(test)]" in text:
            continue
        text = text.split("#[cfg(test)]")[0]
        for ref in references(text, module):
            target = resolve(ref, files)
            if target is None or target == module or not target:
                continue
            graph[module].add(target)
            if parent_free(src_dir, module) and module[: len(target)] == target:
                errors.append(
                    f"{src_dir}/{path.relative_to(src)}: imports its parent module "
                    f"`{'::'.join(target)}`; move what it needs into a file beside it"
                )
            a, b = module[0], target[0]
            if a == b:
                continue
            la, lb = layer_of.get(a), layer_of.get(b)
            if la is None or lb is None:
                errors.append(
                    f"{src_dir}: module `{a if la is None else b}` has no layer in {Path(__file__).name}"
                )
            elif lb <= la:
                errors.append(
                    f"{src_dir}/{path.relative_to(src)}: `{a}` imports `{'::'.join(target)}`, "
                    f"which is not in a layer below it"
                )
    cycles = find_cycles(graph)
    for cycle in cycles:
        errors.append(
            f"{src_dir}: files import each other in a circle: "
            + " -> ".join("::".join(m) for m in cycle)
        )
    return len(files), sum(len(v) for v in graph.values())


def find_cycles(graph: dict[tuple[str, ...], set[tuple[str, ...]]]) -> list[list[tuple[str, ...]]]:
    """One cycle per strongly connected component of more than one file (Tarjan)."""
    index: dict = {}
    low: dict = {}
    stack: list = []
    on_stack: set = set()
    found: list = []
    counter = [0]
    sys.setrecursionlimit(10_000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component) + [min(component)])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def check_core_dependencies(errors: list[str]) -> None:
    manifest = (ROOT / "core/Cargo.toml").read_text()
    deps = manifest.split("[dependencies]", 1)[1].split("\n[", 1)[0]
    for line in deps.splitlines():
        name = line.split("=", 1)[0].split(".", 1)[0].strip()
        if name in CORE_FORBIDDEN:
            errors.append(f"core/Cargo.toml: the pure core depends on `{name}`")
    for path in (ROOT / "core/src").rglob("*.rs"):
        code = COMMENT.sub("", path.read_text())
        for crate in CORE_FORBIDDEN:
            if re.search(rf"\b{crate.replace('-', '_')}::", code):
                errors.append(f"{path.relative_to(ROOT)}: names the I/O crate `{crate}`")


def python_modules(package: Path) -> dict[str, Path]:
    """Dotted module name (`gradflow.capture.hooks`; a package's `__init__.py` is the
    package) → file."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def python_imports(path: Path, module: str, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """The package's modules that a file imports, with the line of each import."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from pkg import name`: the submodule `name` when there is one.
            names = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                out.append((name, node.lineno))
    return out


def python_layer(module: str) -> str | None:
    parts = module.split(".")
    return PY_LAYER_OF.get(parts[1] if len(parts) > 1 else "__init__")


def check_python(package: Path, errors: list[str]) -> tuple[int, int]:
    """The Python package's layers (see PY_LAYER_OF): every import downward, no circle."""
    modules = python_modules(package)
    graph: dict[tuple[str, ...], set[tuple[str, ...]]] = {(m,): set() for m in modules}
    for module, path in modules.items():
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        layer = python_layer(module)
        if layer is None:
            errors.append(f"{where}: `{module}` has no layer in {Path(__file__).name}")
            continue
        for target, line in python_imports(path, module, modules):
            if target == module:
                continue
            graph[(module,)].add((target,))
            other = python_layer(target)
            if other is None or other == layer or (module, target) in PY_ALLOWED:
                continue
            if other not in PY_MAY_IMPORT[layer]:
                errors.append(
                    f"{where}:{line}: `{module}` ({layer}) imports `{target}` ({other}), "
                    f"which is not in a layer below it"
                )
    for cycle in find_cycles(graph):
        errors.append(
            f"{package.name}: modules import each other in a circle: "
            + " -> ".join(m[0] for m in cycle)
        )
    return len(modules), sum(len(v) for v in graph.values())


def main() -> int:
    errors: list[str] = []
    totals = [check_crate(src, errors) for src in LAYERS]
    totals.append(check_python(ROOT / PY_PACKAGE, errors))
    check_core_dependencies(errors)
    if errors:
        for e in dict.fromkeys(errors):
            print(f"error: {e}", file=sys.stderr)
        return 1
    files = sum(t[0] for t in totals)
    edges = sum(t[1] for t in totals)
    print(f"layering ok: {files} files, {edges} imports, every import downward, no circle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
