"""The layers of metering/ and the one direction imports run between them.

A walk over every module's imports (ast, nothing imported; function bodies and TYPE_CHECKING
blocks included) fails on an arrow the table below does not allow, on a cycle between packages
or top-level modules, and on a read of the app's state outside metering.container. The package
map of docs/development/architecture.md is checked against the same table.
"""

import ast
import concurrent.futures
import gc
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "metering"
ARCHITECTURE = ROOT.parent / "docs" / "development" / "architecture.md"

# Bottom to top: (layer, what sits there, {unit: the units it may import}). A unit is a package
# (`ledger/`) or a top-level module (`db.py`) of metering/. The foundation is open: every layer
# above may import any of it. Any other arrow is listed, and points to a lower layer or to a
# unit of its own layer (the listed arrows are checked for cycles).
LAYERS: tuple[tuple[str, str, dict[str, set[str]]], ...] = (
    (
        "foundation",
        "values, settings, the database, the clock, errors, the counters: nothing of a domain",
        {
            "numbers": set(),
            "ids": set(),
            "timefmt": set(),
            "clock": set(),
            "errors": set(),
            "limits": set(),
            "text": {"errors"},
            "money": {"numbers"},
            "requestid": {"ids"},
            "encoding": {"errors"},
            "dburl": set(),
            "settings": {"dburl", "money", "timefmt"},
            "db": {"clock", "dburl"},
            "metrics": {"money"},
        },
    ),
    (
        "container",
        "the long-lived objects of one process; the domains register into it",
        {"container": set()},
    ),
    (
        "data",
        "the tables but the ledger's, and the catalog's prices",
        {"models": set(), "catalog": {"models"}},
    ),
    ("ledger", "the event, its tables, its one writer", {"ledger": {"models"}}),
    ("auth", "credentials -> principal", {"auth": {"container", "models"}}),
    ("alerts", "alert events and their delivery", {"alerts": {"auth", "container", "models"}}),
    (
        "budgets",
        "reserve, settle, leases, rates, runs",
        {"budgets": {"alerts", "auth", "container", "ledger", "models"}},
    ),
    (
        "services",
        "the use cases over budgets and the ledger, with their routes; the scheduled jobs",
        {
            "identity": {"alerts", "auth", "budgets", "container", "models"},
            "billing": {"auth", "budgets", "container", "ledger", "models"},
            "reports": {"alerts", "auth", "budgets", "container", "ledger", "models"},
            "responses": {"auth", "container"},
            "proxy": {"auth", "budgets", "container", "ledger", "models", "responses"},
            "dashboard": {"auth"},
            "jobs": {"alerts", "budgets", "ledger", "models", "responses"},
        },
    ),
    (
        "app",
        "the composition root: routers, lifespan, the container filled",
        {
            "app": {
                "alerts",
                "auth",
                "billing",
                "budgets",
                "catalog",
                "container",
                "dashboard",
                "identity",
                "jobs",
                "proxy",
                "reports",
                "responses",
            },
        },
    ),
    (
        "commands",
        "what runs the app, and the simulated upstream it runs against",
        {
            "sim": set(),
            "migrate": set(),
            "server": set(),
            "testing": {"app", "server"},
            "demo": {"app", "migrate", "server", "sim"},
            "cli": {"app", "billing", "demo", "migrate", "reports", "server"},
        },
    ),
)
LAYER = {unit: n for n, (_, _, units) in enumerate(LAYERS) for unit in units}
MAY_IMPORT = {unit: allowed for _, _, units in LAYERS for unit, allowed in units.items()}
FOUNDATION = set(LAYERS[0][2])
# The one module that reads (and sets) the app's state: the container is there.
STATE_READERS = {"metering.container"}
# The simulated upstream is an app of its own: its state is its own.
OWN_STATE = ("sim",)


def table(problems: object = None) -> str:
    """What failed, then the whole table: each failure below prints it."""
    lines = [str(problems), ""] if problems else []
    lines.append(
        "The layers, bottom to top; each unit and what it may import (and the foundation):"
    )
    for n, (layer, what, units) in enumerate(LAYERS):
        lines.append(f"{n} {layer}: {what}")
        lines.extend(f"    {unit}: {', '.join(sorted(units[unit])) or '-'}" for unit in units)
    return "\n".join(lines)


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


def unit_of(module: str) -> str | None:
    """The package or top-level module of metering/ that `module` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def units() -> set[str]:
    """Every package and top-level module of metering/."""
    return {
        path.stem if path.is_file() else path.name
        for path in ROOT.iterdir()
        if (path.suffix == ".py" and path.stem != "__init__") or (path / "__init__.py").is_file()
    }


def arrows() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) unit -> the module imports that make the arrow."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        source = unit_of(module_name(path))
        if source is None:
            continue
        for target_module in sorted(imported_modules(path)):
            target = unit_of(target_module)
            if target is not None and target != source:
                found.setdefault((source, target), []).append(
                    f"{module_name(path)} -> {target_module}"
                )
    return found


def allowed(importer: str, imported: str) -> bool:
    if importer not in LAYER or imported not in LAYER:
        return False
    if imported in FOUNDATION and LAYER[importer] > 0:
        return True
    return imported in MAY_IMPORT[importer]


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one unit (Tarjan)."""
    nodes = sorted({node for edge in edges for node in edge})
    graph = {p: sorted(b for a, b in edges if a == p) for p in nodes}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

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

    for node in nodes:
        if node not in index:
            visit(node)
    return found


def test_every_package_and_module_has_its_place_in_the_table():
    found, placed = units(), set(LAYER)
    unplaced, gone = sorted(found - placed), sorted(placed - found)
    assert (unplaced, gone) == ([], []), table(f"not in the table: {unplaced}; gone: {gone}")


def test_the_table_points_down():
    """Each listed arrow goes to a lower layer or along its own, and those along a layer make
    no cycle: the table itself runs one way."""
    up = [
        f"{importer} ({LAYERS[LAYER[importer]][0]}) -> {imported} ({LAYERS[LAYER[imported]][0]})"
        for importer, targets in MAY_IMPORT.items()
        for imported in sorted(targets)
        if LAYER[imported] > LAYER[importer]
    ]
    along = {(a, b) for a, targets in MAY_IMPORT.items() for b in targets}
    assert (up, cycles(along)) == ([], []), table(f"upward: {up}; cycles: {cycles(along)}")


def test_the_walk_sees_the_imports_it_must_judge():
    """The walk finds known arrows, so an empty result below means something."""
    found = arrows()
    assert any(
        line.startswith("metering.proxy.attempt -> metering.budgets.")
        for line in found[("proxy", "budgets")]
    )
    assert any(line.endswith("-> metering.ledger.writer") for line in found[("budgets", "ledger")])
    assert "metering.reports.usage -> metering.ledger.event" in found[("reports", "ledger")]
    assert ("text", "errors") in found and ("cli", "app") in found


def test_no_import_runs_against_the_table():
    wrong = [
        f"{importer} -> {imported}, not allowed: {', '.join(lines)}"
        for (importer, imported), lines in sorted(arrows().items())
        if not allowed(importer, imported)
    ]
    assert wrong == [], table("\n".join(wrong))


def test_no_import_cycle_between_packages_or_modules():
    found = cycles(set(arrows()))
    assert found == [], table(f"cycles: {found}")


def test_cycles_are_found():
    assert cycles({("ledger", "budgets"), ("budgets", "proxy"), ("proxy", "ledger")}) == [
        ["budgets", "ledger", "proxy"]
    ]
    assert cycles({("proxy", "budgets"), ("budgets", "ledger")}) == []


# The top of the path: a package's routes, and the proxy's raw ASGI dispatcher beside them.
ENTRY_POINTS = {"endpoints", "metering.proxy.dispatch"}


def test_only_the_app_imports_endpoints():
    """Endpoints (and the dispatcher that serves the chat route ahead of them) are the top of the
    path: services and data never import them, nor one another; the app wires them."""
    wrong = [
        f"{module_name(path)} -> {target}"
        for path in sorted(ROOT.rglob("*.py"))
        if module_name(path) != "metering.app"
        for target in sorted(imported_modules(path))
        if {target, target.rpartition(".")[2]} & ENTRY_POINTS and target != module_name(path)
    ]
    assert wrong == []


def state_reads(tree: ast.AST) -> list[int]:
    """The lines that reach the app's state: `<...>.app.state`, `app.state`, `application.state`
    (any depth: `self.application.state`, `request.app.state`), and any `.state.services`."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
        apps_state = node.attr == "state" and name in ("app", "application")
        if apps_state or (node.attr == "services" and name == "state"):
            lines.append(node.lineno)
    return sorted(set(lines))


def test_the_state_check_sees_every_way_to_the_state():
    source = """
services = self.application.state.services
services = connection.app.state.services
app.state.services = services
stash = request.app.state
anything.state.services
"""
    assert state_reads(ast.parse(source)) == [2, 3, 4, 5, 6]
    assert state_reads(ast.parse("request.state.request_id\nscope['state']\n")) == []


def test_nothing_but_the_container_reads_the_app_state():
    """Endpoints get the container from its dependency (metering.container.get_services);
    nothing else reaches FastAPI's app state."""
    readers = {
        module_name(path): lines
        for path in sorted(ROOT.rglob("*.py"))
        if module_name(path) not in STATE_READERS
        and path.relative_to(ROOT).parts[0] not in OWN_STATE
        and (lines := state_reads(parse(path)))
    }
    assert readers == {}


def map_cell(unit: str) -> str:
    """The `may import` cell of a unit's row in the documented package map."""
    listed = ", ".join(f"`{name}`" for name in sorted(MAY_IMPORT[unit]))
    if LAYER[unit] == 0:
        return listed or "nothing of ours"
    return f"the foundation, {listed}" if listed else "the foundation"


def map_rows() -> dict[str, tuple[str, str]]:
    """unit -> (layer, may import) as the documented package map has them."""
    text = ARCHITECTURE.read_text()
    section = text.split("\n## Package map\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`([a-z_]+)(?:\.py|/)`", cells[0]) if len(cells) == 4 else None
        if match:
            rows[match[1]] = (cells[1], cells[3])
    return rows


def test_the_documented_package_map_is_the_table():
    expected = {unit: (LAYERS[LAYER[unit]][0], map_cell(unit)) for unit in LAYER}
    found = map_rows()
    differ = {
        unit: f"the package map has {found.get(unit)}, the table {expected.get(unit)}"
        for unit in sorted(set(expected) | set(found))
        if found.get(unit) != expected.get(unit)
    }
    assert differ == {}, table("\n".join(f"{unit}: {what}" for unit, what in differ.items()))
