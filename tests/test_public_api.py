"""The public surface is listed in one place, docs/reference/api.md, and nowhere grows or
shrinks unseen: each public module's ``__all__`` is exactly what the table lists for it, and
every other module of the package is internal by where it lives."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import django_pgjobs

API = Path(__file__).resolve().parent.parent / "docs" / "reference" / "api.md"

# Where internal modules live (docs/reference/api.md says so under its table), and the modules
# Django loads by name.
INTERNAL_PACKAGES = ("core", "worker", "ops", "management", "migrations")
LOADED_BY_DJANGO = {"apps", "admin"}


def documented() -> dict[str, set[str]]:
    """Module -> the names the table's `from MODULE import a, b` rows list for it."""
    table = API.read_text().split("## Job functions")[0]
    listed: dict[str, set[str]] = {}
    for module, names in re.findall(r"^\| `from (\S+) import ([^`]+)` \|", table, re.M):
        listed.setdefault(module, set()).update(n.strip() for n in names.split(","))
    return listed


def modules() -> list[str]:
    """Every module of the package, by dotted name."""
    found = ["django_pgjobs"]
    for info in pkgutil.walk_packages(django_pgjobs.__path__, "django_pgjobs."):
        found.append(info.name)
    return found


def test_each_public_module_exports_exactly_what_the_docs_list() -> None:
    listed = documented()
    assert "django_pgjobs" in listed and "django_pgjobs.models" in listed, listed
    for module, names in listed.items():
        exported = set(importlib.import_module(module).__all__)
        assert exported == names, (
            f"{module}.__all__ and docs/reference/api.md disagree: only exported "
            f"{sorted(exported - names)}, only documented {sorted(names - exported)}"
        )


def test_every_other_module_is_internal() -> None:
    listed = documented()
    public = []
    for name in modules():
        parts = name.split(".")[1:]
        internal = (
            (parts and parts[0] in INTERNAL_PACKAGES and name not in listed)
            or any(part.startswith("_") for part in parts)
            or (len(parts) == 1 and parts[0] in LOADED_BY_DJANGO)
        )
        if not internal:
            public.append(name)
    assert sorted(public) == sorted(listed), (
        "modules that are neither listed in docs/reference/api.md nor internal: "
        f"{sorted(set(public) - set(listed))}"
    )
