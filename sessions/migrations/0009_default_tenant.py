"""Every existing user, session and job into the default tenant (issue 29).

Users become members of ``default`` with it as their default tenant; sessions and jobs with no
tenant are set to it. Reversing only clears the tenant columns and memberships it added: the
``default`` row stays, since later rows may name it.
"""

from django.conf import settings
from django.db import migrations

DEFAULT_NAME = "default"


def forwards(apps, schema_editor):
    Tenant = apps.get_model("streams", "Tenant")
    Membership = apps.get_model("streams", "TenantMembership")
    User = apps.get_model(*settings.AUTH_USER_MODEL.split("."))
    tenant, _ = Tenant.objects.get_or_create(name=DEFAULT_NAME)
    have_default = set(Membership.objects.filter(is_default=True).values_list("user_id", flat=True))
    members = set(Membership.objects.filter(tenant=tenant).values_list("user_id", flat=True))
    Membership.objects.bulk_create(
        [
            Membership(tenant=tenant, user_id=pk, is_default=pk not in have_default)
            for pk in User.objects.values_list("pk", flat=True)
            if pk not in members
        ],
        batch_size=1000,
    )
    apps.get_model("streams", "GenerationSession").objects.filter(tenant__isnull=True).update(tenant=tenant)
    apps.get_model("streams", "Job").objects.filter(tenant__isnull=True).update(tenant=tenant)


def backwards(apps, schema_editor):
    apps.get_model("streams", "GenerationSession").objects.update(tenant=None)
    apps.get_model("streams", "Job").objects.update(tenant=None)
    apps.get_model("streams", "TenantMembership").objects.filter(tenant__name=DEFAULT_NAME).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("streams", "0008_tenants"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [migrations.RunPython(forwards, backwards)]
