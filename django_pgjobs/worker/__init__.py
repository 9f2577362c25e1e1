"""The worker: a producer (this process's main loop), executors, a completer and a listener.

``Worker(...).run()`` is what ``manage.py runjobs`` runs; use it from Python or tests alike.
"""

from django_pgjobs.worker.worker import Worker, WorkerStats

__all__ = ["Worker", "WorkerStats"]
