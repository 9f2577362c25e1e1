"""The SQL the docs show is the SQL django-pgjobs sends (scripts/docs_sql.py).

The first three tests read the real docs, with the statements as the app's modules and the
migrations define them at the time the test runs. The others hand the checker small docs with one
kind of mistake each, so that each guard is shown to catch what it is for.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from django_pgjobs.core import claim, finish
from scripts import docs_sql

ARTICLE = next(iter(docs_sql.SOURCES))


def found(kind: docs_sql.Kind, root: Path = docs_sql.ROOT) -> list[str]:
    return [str(problem) for problem in docs_sql.check(root) if problem.kind == kind]


def test_marked_blocks_match_their_statements() -> None:
    drift = found("drift")
    assert not drift, "SQL blocks out of step (python scripts/docs_sql.py):\n" + "\n".join(drift)


def test_every_sql_block_is_marked() -> None:
    unmarked = found("unmarked")
    assert not unmarked, "SQL blocks without a marker:\n" + "\n".join(unmarked)


def test_every_marker_names_something_that_exists() -> None:
    unknown = found("unknown")
    assert not unknown, "markers that name nothing:\n" + "\n".join(unknown)


def page(root: Path, text: str) -> Path:
    path = root / "docs" / "page.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return path


def script(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            str(docs_sql.ROOT / "scripts" / "docs_sql.py"),
            "--root",
            str(root),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def indented(text: str, indent: str) -> str:
    return "\n".join(indent + line if line else "" for line in text.strip("\n").split("\n"))


def test_a_statement_that_changed_is_found_and_rewritten(tmp_path: Path) -> None:
    stale_claim = claim.CLAIM.replace("FOR UPDATE SKIP LOCKED", "FOR UPDATE")
    stale_claim = "\n".join(line for line in stale_claim.split("\n") if line)
    path = page(
        tmp_path,
        f"""
        # Claims

        <!-- core.claim.CLAIM -->
        ```sql
{indented(stale_claim, " " * 8)}
        ```

        - In a list:

            <!-- migration.0002_job_results -->
            ```sql
            ALTER TABLE pgjobs_job ADD COLUMN attempted_at timestamptz;
            ```
        """,
    )
    in_list = 10 + stale_claim.count("\n") + 1  # after the heading, the claim, the list item
    assert found("drift", tmp_path) == [
        "docs/page.md:4: differs from core.claim.CLAIM: run scripts/docs_sql.py",
        f"docs/page.md:{in_list}: differs from migration.0002_job_results: run scripts/docs_sql.py",
    ]
    assert script(tmp_path, "--check").returncode == 1
    assert "FOR UPDATE SKIP LOCKED" not in path.read_text(encoding="utf-8"), "--check wrote"

    rewritten = script(tmp_path)
    assert (rewritten.returncode, rewritten.stdout) == (0, "rewrote docs/page.md\n")
    text = path.read_text(encoding="utf-8")
    claimed = "\n".join(line for line in claim.CLAIM.strip("\n").split("\n") if line)
    assert f"<!-- core.claim.CLAIM -->\n```sql\n{claimed}\n```\n" in text
    assert "    ```sql\n    SET LOCAL lock_timeout = '5s';\n    ALTER TABLE pgjobs_job\n" in text
    assert script(tmp_path, "--check").returncode == 0
    assert found("drift", tmp_path) == []


def test_an_sql_block_without_a_marker_is_found(tmp_path: Path) -> None:
    page(
        tmp_path,
        """
        ```sql
        SELECT 1;
        ```

        <!-- see sql.py -->
        ```postgresql
        SELECT 2;
        ```

        <!-- example -->

        ```sql
        SELECT 3;
        ```

        ```python
        cursor.execute("SELECT 4")
        ```
        """,
    )
    assert [line.split(": ")[0] for line in found("unmarked", tmp_path)] == [
        "docs/page.md:1",
        "docs/page.md:6",
        "docs/page.md:12",
    ]
    result = script(tmp_path, "--check")
    assert result.returncode == 1
    assert "docs/page.md:1: unmarked SQL block" in result.stderr


def test_a_marker_that_names_nothing_is_found(tmp_path: Path) -> None:
    page(
        tmp_path,
        """
        <!-- core.claim.CLAIM_ALL -->
        ```sql
        ```

        <!-- core.execute.run -->
        ```sql
        ```

        <!-- migration.0999_nothing -->
        ```sql
        ```

        <!-- excerpt: core.finish.COMPLETED -->
        ```sql
        WHERE j.status = 'running'
        ```

        <!-- quoted: Postgres queues for the impatient -->
        ```sql
        SELECT 1;
        ```
        """,
    )
    assert found("unknown", tmp_path) == [
        "docs/page.md:2: <!-- core.claim.CLAIM_ALL -->: django_pgjobs.core.claim.CLAIM_ALL: "
        "no such constant",
        "docs/page.md:6: <!-- core.execute.run -->: django_pgjobs.core.execute.run: "
        "not a statement",
        "docs/page.md:10: <!-- migration.0999_nothing -->: "
        "no migration django_pgjobs/migrations/0999_nothing.py",
        "docs/page.md:14: <!-- excerpt: core.finish.COMPLETED -->: "
        "django_pgjobs.core.finish.COMPLETED: no such constant",
        "docs/page.md:19: <!-- quoted: Postgres queues for the impatient -->: no source article "
        f"titled 'Postgres queues for the impatient' (they are: {'; '.join(docs_sql.SOURCES)})",
    ]
    assert script(tmp_path).returncode == 1


def test_an_excerpt_is_checked_and_never_rewritten(tmp_path: Path) -> None:
    fence = [line for line in finish.COMPLETE.split("\n") if "j.status = 'running'" in line]
    text = f"""
        <!-- excerpt: core.finish.COMPLETE -->
        ```sql
        {fence[0]}
        ```

        <!-- excerpt: core.finish.COMPLETE -->
        ```sql
        WHERE j.id = mine.id AND j.status = 'queued'
        ```

        <!-- quoted: {ARTICLE} -->
        ```sql
        UPDATE jobs SET status = 'done' WHERE id = 1;
        ```
        """
    path = page(tmp_path, text)
    assert found("drift", tmp_path) == [
        "docs/page.md:7: these lines are not in core.finish.COMPLETE (any more): edit the excerpt"
    ]
    assert found("unknown", tmp_path) == found("unmarked", tmp_path) == []
    before = path.read_text(encoding="utf-8")
    result = script(tmp_path)
    assert result.returncode == 1
    assert "docs/page.md:7: these lines are not in core.finish.COMPLETE" in result.stderr
    assert path.read_text(encoding="utf-8") == before
