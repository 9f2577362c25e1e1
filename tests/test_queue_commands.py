"""``manage.py pausequeue`` and ``resumequeue``: thin shells over ``Job.objects.pause`` and
``resume``, read back from the ``pgjobs_queue`` row they write."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from tests.helpers import query

pytestmark = pytest.mark.django_db


def paused(name: str) -> bool | None:
    rows = query("SELECT paused FROM pgjobs_queue WHERE name = %s", [name])
    return rows[0][0] if rows else None


def run(command: str, *args: str) -> str:
    out = StringIO()
    call_command(command, *args, stdout=out)
    return out.getvalue()


def test_pausequeue_then_resumequeue_say_what_they_did() -> None:
    assert run("pausequeue", "emails") == (
        "paused queue emails: its jobs stay queued until `manage.py resumequeue emails`; jobs "
        "already running finish\n"
    )
    assert paused("emails") is True
    # Pausing again is no error, and leaves other queues alone.
    run("pausequeue", "emails", "--database", "default")
    assert (paused("emails"), paused("reports")) == (True, None)

    assert run("resumequeue", "emails") == "resumed queue emails: workers claim its jobs again\n"
    assert paused("emails") is False


def test_a_bad_queue_name_is_refused_with_the_problem_named() -> None:
    for command in ("pausequeue", "resumequeue"):
        with pytest.raises(CommandError, match=r"Invalid queue name 'no spaces': use 1-100 "):
            run(command, "no spaces")
    assert query("SELECT count(*) FROM pgjobs_queue") == [(0,)]
    with pytest.raises(CommandError, match="the following arguments are required: NAME"):
        run("pausequeue")
