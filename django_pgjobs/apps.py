from __future__ import annotations

from importlib import import_module

from django.apps import AppConfig
from django.utils.module_loading import autodiscover_modules


class PgJobsConfig(AppConfig):
    name = "django_pgjobs"
    verbose_name = "Jobs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django_pgjobs.core import checks, conf

        checks.register()
        # Job functions register themselves when their module is imported: every app's
        # jobs.py and tasks.py, then the modules named in PGJOBS["IMPORTS"].
        autodiscover_modules("jobs", "tasks")
        imports = conf.get("IMPORTS")
        if isinstance(imports, (list, tuple)):
            for module in imports:
                import_module(module)
