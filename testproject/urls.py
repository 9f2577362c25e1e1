from django.contrib import admin
from django.urls import path

from django_pgjobs import views as pgjobs_views
from testproject.shop import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("orders/", views.place_order, name="place-order"),
    # The queue's monitoring views (docs/monitoring.md): staff sessions or the bearer token.
    path("pgjobs/metrics", pgjobs_views.metrics, name="pgjobs-metrics"),
    path("pgjobs/health", pgjobs_views.health, name="pgjobs-health"),
]
