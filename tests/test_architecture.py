"""The request path reads in one direction: a walk over every module's imports (ast, nothing
imported) fails on an arrow that runs the wrong way or on a cycle between packages."""

import ast
import concurrent.futures
import gc
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "metering"
PACKAGES = ("ledger", "budgets", "proxy", "reports", "identity", "auth", "alerts")
# package -> packages it must never import
FORBIDDEN = {
    "budgets": {"reports", "proxy"},
    "reports": {"proxy"},
    "ledger": {"proxy", "reports", "budgets", "identity", "auth"},
    # Alerts are written by budgets, reports and jobs: they read none of them.
    "alerts": {"proxy", "budgets", "reports", "identity"},
}
# (importer, imported) package arrows that exist today against FORBIDDEN or in a cycle, each
# with its reason; empty is the goal.
KNOWN = {}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str) -> bool:
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def parse(path: Path) -> ast.Module:
    """ast.parse in a thread of its own (a shallow stack) with the collector paused: CPython
    3.11.7 can raise "SystemError: AST constructor recursion depth mismatch" while it builds the
    tree, as it once did here under pytest-xdist (CPython gh-106905, fixed in later releases)."""
    source = path.read_text()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(ast.parse, source, str(path)).result()
    finally:
        if collecting:
            gc.enable()


def imported_modules(path: Path) -> set[str]:
    """Every metering module `path` imports, at any depth of its code (function bodies and
    TYPE_CHECKING blocks included)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            found.add(source)
            # `from metering import proxy` imports the module (here a package) metering.proxy.
            found.update(
                f"{source}.{alias.name}"
                for alias in node.names
                if is_module(f"{source}.{alias.name}")
            )
    return {m for m in found if m == "metering" or m.startswith("metering.")}


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PACKAGES else None


def package_arrows() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) package -> the module imports that make the arrow."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        source = package_of(module_name(path))
        if source is None:
            continue
        for target_module in sorted(imported_modules(path)):
            target = package_of(target_module)
            if target is not None and target != source:
                arrows.setdefault((source, target), []).append(
                    f"{module_name(path)} -> {target_module}"
                )
    return arrows


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan)."""
    graph = {p: sorted(b for a, b in edges if a == p) for p in PACKAGES}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in PACKAGES:
        if node not in index:
            visit(node)
    return found


def test_the_walk_sees_the_imports_it_must_judge():
    """The walk finds known arrows, so an empty result below means something."""
    arrows = package_arrows()
    assert "metering.proxy.attempt -> metering.budgets.reserve" in arrows[("proxy", "budgets")]
    assert "metering.budgets.settle -> metering.ledger.writer" in arrows[("budgets", "ledger")]
    assert "metering.reports.usage -> metering.ledger.event" in arrows[("reports", "ledger")]


@pytest.mark.parametrize("importer", sorted(FORBIDDEN))
def test_no_import_runs_the_wrong_way(importer):
    arrows = package_arrows()
    wrong = {
        (importer, imported): arrows[(importer, imported)]
        for imported in FORBIDDEN[importer]
        if (importer, imported) in arrows and (importer, imported) not in KNOWN
    }
    assert wrong == {}


def test_no_import_cycle_between_packages():
    edges = set(package_arrows()) - set(KNOWN)
    assert cycles(edges) == []


def test_the_known_exceptions_still_exist():
    """An exception that was fixed is removed from KNOWN, so it cannot come back unseen."""
    arrows = package_arrows()
    assert [pair for pair in KNOWN if pair not in arrows] == []


def test_cycles_are_found():
    assert cycles({("ledger", "budgets"), ("budgets", "proxy"), ("proxy", "ledger")}) == [
        ["budgets", "ledger", "proxy"]
    ]
    assert cycles({("proxy", "budgets"), ("budgets", "ledger")}) == []


def test_only_the_app_imports_endpoints():
    """Endpoints are the top of the path: services and data never import routes."""
    wrong = [
        f"{module_name(path)} -> {target}"
        for path in sorted(ROOT.rglob("*.py"))
        if module_name(path) != "metering.app"
        for target in sorted(imported_modules(path))
        if target.rpartition(".")[2] == "endpoints" and target != module_name(path)
    ]
    assert wrong == []
