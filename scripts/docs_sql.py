"""Keep the SQL shown in the docs in step with the SQL django-pgjobs sends.

Every ```sql block in README.md, docs/ and benchmarks/ says what it is, in an HTML comment on
the line just before its opening fence:

    <!-- core.claim.CLAIM -->               django_pgjobs.core.claim.CLAIM (blank lines out)
    <!-- migration.0002_job_results -->     the SQL that migration runs (its RunSQL), exactly
    <!-- excerpt: core.finish.COMPLETE -->  consecutive lines of that text, to discuss one part
    <!-- quoted: TITLE -->                  SQL printed by one of the source articles (SOURCES)
    <!-- example -->                        SQL written for the page: a query to run, a sketch

Run without arguments, this script rewrites each block of the first two kinds from the current
text of what it names, so a changed statement reaches the docs in one step. With --check it
changes nothing: it prints every block that is out of step, unmarked, or names something that
does not exist, and exits 1 (tests/test_docs_sql.py runs the same check). An excerpt is never
rewritten, only checked: once its lines are gone from the statement, a person must edit it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Literal

import django
from django.db import migrations

ROOT = Path(__file__).resolve().parent.parent

# The articles the project is built from, by their original titles (in Chinese) and an English
# rendering. A quoted block names its article by the original title.
SOURCES = {
    "用 Postgres 做任务队列：把 FOR UPDATE SKIP LOCKED 用对": (  # noqa: RUF001 (its own colon)
        "Postgres as a job queue: using FOR UPDATE SKIP LOCKED correctly"
    ),
    "SKIP LOCKED 队列与在线 DDL": "SKIP LOCKED queues and online DDL",
}

SQL_LANGUAGES = frozenset({"sql", "pgsql", "plpgsql", "postgres", "postgresql"})

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^\s`]*)[^`]*$")
_MARKER = re.compile(r"^<!--\s*(?P<text>.*?)\s*-->$")
# A statement is named by its module under django_pgjobs and its constant: core.claim.CLAIM.
_REFERENCE = re.compile(
    r"^(?:(?P<kind>migration)|(?P<module>[a-z_]+(?:\.[a-z_]+)*))\.(?P<name>\w+)$"
)

# drift: the block's text is not (or, for an excerpt, no longer in) what it names.
# unmarked: no marker, or not one of the kinds above. unknown: it names nothing that exists.
Kind = Literal["drift", "unmarked", "unknown"]


@dataclass(frozen=True)
class Problem:
    kind: Kind
    path: str
    line: int
    message: str
    fixable: bool = False  # rewriting the file fixes it

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


@dataclass(frozen=True)
class Block:
    """One fenced SQL block: ``lines[start]`` is its opening fence, ``lines[end]`` its closing."""

    start: int
    end: int
    indent: str
    marker: str | None
    body: tuple[str, ...]


def doc_files(root: Path) -> list[Path]:
    """The Markdown a user reads: README.md, docs/, benchmarks/ (not hidden folders such as
    the peers' virtualenvs)."""
    files = [root / "README.md"] if (root / "README.md").exists() else []
    for folder in ("docs", "benchmarks"):
        files += sorted(
            path
            for path in (root / folder).rglob("*.md")
            if not any(part.startswith(".") for part in path.relative_to(root).parts)
        )
    return files


def sql_blocks(lines: Sequence[str]) -> Iterator[Block]:
    """Every fenced block whose language is SQL, with the marker on the line before it."""
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        end = index + 1
        while end < len(lines) and not re.match(
            rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[end]
        ):
            end += 1
        if opening["info"].lower() in SQL_LANGUAGES:
            before = lines[index - 1].strip() if index else ""
            marker = _MARKER.match(before)
            yield Block(
                start=index,
                end=end,
                indent=indent,
                marker=marker["text"] if marker else None,
                body=tuple(_dedent(line, indent) for line in lines[index + 1 : end]),
            )
        index = end + 1


def _dedent(line: str, indent: str) -> str:
    line = line.rstrip()
    return line[len(indent) :] if line.startswith(indent) else line.lstrip()


def statement_lines(text: str | Sequence[str]) -> tuple[str, ...]:
    """A statement as the docs show it: without the blank lines around it or trailing
    spaces; a list of statements (as RunSQL takes them) one after another, each ending in ;."""
    if not isinstance(text, str):
        text = "\n".join(
            part.strip() if part.strip().endswith(";") else part.strip() + ";" for part in text
        )
    return tuple(line.rstrip() for line in textwrap.dedent(text).strip("\n").splitlines())


class UnknownReference(LookupError):
    """A marker names a constant, a migration or an article that does not exist."""


def resolve(reference: str) -> tuple[str, ...]:
    """The current text of ``MODULE.NAME`` (a statement of django_pgjobs.MODULE) or
    ``migration.NAME``, read now (not at import)."""
    match = _REFERENCE.match(reference)
    if not match:
        raise UnknownReference(f"{reference!r} is neither MODULE.NAME nor migration.NAME")
    if match["module"]:
        path = f"django_pgjobs.{match['module']}"
        try:
            module = importlib.import_module(path)
        except ModuleNotFoundError:
            raise UnknownReference(f"{path}: no such module") from None
        value = getattr(module, match["name"], None)
        # Statements are the upper-case constants (a type alias is a string too).
        if not isinstance(value, str) or not match["name"].isupper():
            what = "no such constant" if value is None else "not a statement"
            raise UnknownReference(f"{path}.{match['name']}: {what}")
        # One statement joined from fragments: a blank line inside it is where two were joined.
        return tuple(line for line in statement_lines(value) if line)
    try:
        module = importlib.import_module(f"django_pgjobs.migrations.{match['name']}")
    except ModuleNotFoundError:
        raise UnknownReference(
            f"no migration django_pgjobs/migrations/{match['name']}.py"
        ) from None
    statements = _run_sql(module)
    if not statements:
        raise UnknownReference(f"migration {match['name']} runs no SQL of its own (no RunSQL)")
    return statement_lines(statements)


def _run_sql(module: ModuleType) -> list[str]:
    found: list[str] = []

    def visit(operations: Sequence[object]) -> None:
        for operation in operations:
            if isinstance(operation, migrations.SeparateDatabaseAndState):
                visit(operation.database_operations)
            elif isinstance(operation, migrations.RunSQL):
                sql = operation.sql
                for part in [sql] if isinstance(sql, str) else sql:
                    found.append(part if isinstance(part, str) else part[0])

    visit(module.Migration.operations)
    return found


def _is_excerpt(body: Sequence[str], text: Sequence[str]) -> bool:
    size = len(body)
    return size > 0 and any(
        tuple(text[i : i + size]) == tuple(body) for i in range(len(text) - size + 1)
    )


_UNMARKED = (
    "put a marker on the line before the block: <!-- core.claim.CLAIM -->, "
    "<!-- migration.NAME -->, <!-- excerpt: core.claim.CLAIM -->, <!-- quoted: TITLE --> or "
    "<!-- example -->"
)


def process(path: Path, root: Path) -> tuple[str, list[Problem]]:
    """The file's text with every generated block rewritten from what it names, and every
    problem found, a block that had to be rewritten included."""
    name = path.relative_to(root).as_posix()
    lines = path.read_text(encoding="utf-8").split("\n")
    problems: list[Problem] = []
    replacements: list[tuple[Block, tuple[str, ...]]] = []
    for block in sql_blocks(lines):
        line, marker = block.start + 1, block.marker
        if marker is None:
            problems.append(Problem("unmarked", name, line, f"unmarked SQL block: {_UNMARKED}"))
            continue
        kind, _, rest = marker.partition(":")
        rest = rest.strip()
        try:
            if _REFERENCE.match(marker):
                text = resolve(marker)
                if text != block.body:
                    message = f"differs from {marker}: run scripts/docs_sql.py"
                    problems.append(Problem("drift", name, line, message, fixable=True))
                    replacements.append((block, text))
            elif kind == "excerpt" and rest:
                if not _is_excerpt(block.body, resolve(rest)):
                    message = f"these lines are not in {rest} (any more): edit the excerpt"
                    problems.append(Problem("drift", name, line, message))
            elif kind == "quoted" and rest:
                if rest not in SOURCES:
                    known = "; ".join(SOURCES)
                    raise UnknownReference(f"no source article titled {rest!r} (they are: {known})")
            elif marker != "example":
                message = f"<!-- {marker} --> is not a marker: {_UNMARKED}"
                problems.append(Problem("unmarked", name, line, message))
        except UnknownReference as exc:
            problems.append(Problem("unknown", name, line, f"<!-- {marker} -->: {exc}"))
    for block, text in reversed(replacements):
        lines[block.start + 1 : block.end] = [
            block.indent + statement if statement else "" for statement in text
        ]
    return "\n".join(lines), problems


def check(root: Path = ROOT) -> list[Problem]:
    """Every problem in the docs under ``root``; nothing is written."""
    return [problem for path in doc_files(root) for problem in process(path, root)[1]]


def rewrite(root: Path = ROOT) -> tuple[list[Path], list[Problem]]:
    """Rewrite the generated blocks; return the files changed and the problems left."""
    changed: list[Path] = []
    left: list[Problem] = []
    for path in doc_files(root):
        text, problems = process(path, root)
        if text != path.read_text(encoding="utf-8"):
            path.write_text(text, encoding="utf-8")
            changed.append(path)
        left += [problem for problem in problems if not problem.fixable]
    return changed, left


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    parser.add_argument(
        "--root", type=Path, default=ROOT, help="the repository (default: this one)"
    )
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if args.check:
        problems = check(root)
    else:
        changed, problems = rewrite(root)
        for path in changed:
            print(f"rewrote {path.relative_to(root).as_posix()}")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    # Run as a script: this repository's app, with the test project's settings (some modules
    # that hold statements import the models).
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    django.setup()
    sys.exit(main())
