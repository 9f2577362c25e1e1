"""A minimal Django project for the django-tasks-db peer: settings and the two tasks."""
