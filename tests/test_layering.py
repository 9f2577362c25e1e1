"""The rooms' imports go one way (docs/architecture.md), read from the source: the app's own
modules each module imports, at its top (what runs when it is loaded) or anywhere."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "django_pgjobs"


def imports(*, top: bool = False) -> dict[str, set[str]]:
    """Module -> the app's modules it imports (dotted, without the package's name); with
    ``top``, only the imports that run when it is loaded (not in a function, not for types)."""
    names = {
        ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        for path in PACKAGE.rglob("*.py")
        if "migrations" not in path.parts
    }
    found: dict[str, set[str]] = {}
    for name in names:
        path = PACKAGE / (name.replace(".", "/") + ".py")
        if not path.exists():
            path = PACKAGE / name.replace(".", "/") / "__init__.py"
        used = found.setdefault(name, set())
        tree = ast.parse(path.read_text())
        for node in tree.body if top else ast.walk(tree):
            if isinstance(node, ast.Import):
                used.update(
                    alias.name.removeprefix("django_pgjobs").lstrip(".")
                    for alias in node.names
                    if alias.name.startswith("django_pgjobs")
                )
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("django_pgjobs"):
                base = (node.module or "").removeprefix("django_pgjobs").lstrip(".")
                for alias in node.names:
                    full = f"{base}.{alias.name}".lstrip(".")
                    used.add(full if full in names else base)
    return found


def circles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Each import circle once, as its modules in sorted order."""
    found: set[tuple[str, ...]] = set()

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in graph.get(node, ()):
            if nxt == start:
                found.add(tuple(sorted(path)))
            elif nxt not in path and nxt > start:
                walk(start, nxt, [*path, nxt])

    for module in graph:
        walk(module, module, [module])
    return found


def test_conf_and_the_fragments_import_nothing_of_the_app() -> None:
    graph = imports()
    for bottom in ("core.conf", "core.fragments", "core.execute", "exceptions", "signals"):
        assert graph[bottom] <= {""}, f"{bottom} imports {sorted(graph[bottom])}"


def test_no_module_imports_itself_round_a_circle_when_loaded() -> None:
    # The reaches back happen at call time only: the manager and the enqueue to the model,
    # the registry's JobFunction.enqueue() to the model, a schedule to the tasks backend.
    assert circles(imports(top=True)) == set()


def test_the_state_machine_never_imports_its_shells() -> None:
    shells = ("worker", "ops", "admin", "views", "backends", "testing", "management")
    loaded = imports(top=True)
    for module, used in imports().items():
        if not module.startswith("core."):
            continue
        reached = sorted(u for u in used if u.startswith(shells))
        # A schedule of a django.tasks task asks the tasks backend to register it.
        if module == "core.schedules":
            reached = [u for u in reached if u != "backends"]
        assert not reached, f"{module} imports {reached}"
        # The model and its manager are above core: reached at call time only (to build the
        # Job an enqueue returns, to enqueue from JobFunction.enqueue()), or for types.
        above = sorted(u for u in loaded[module] if u in ("models", "managers"))
        assert not above, f"{module} imports {above} when it is loaded"
