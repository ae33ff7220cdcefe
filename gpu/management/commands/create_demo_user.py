from __future__ import annotations

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Create (or reset) the demo user and a staff operator, and print their credentials."

    def handle(self, *args, **options):
        User = get_user_model()
        for username, password, staff in [
            ("demo", settings.STREAMSERVE["DEMO_PASSWORD"], False),
            ("operator", settings.STREAMSERVE["OPERATOR_PASSWORD"], True),
        ]:
            user, _ = User.objects.get_or_create(username=username)
            user.set_password(password)
            user.is_staff = user.is_superuser = staff
            user.save()
            role = "staff operator (console, admin)" if staff else "demo user"
            self.stdout.write(f"  {role}: username {username!r}, password {password!r}")
