from __future__ import annotations

import os

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Create (or reset) the demo user and a staff operator, and print their credentials."

    def handle(self, *args, **options):
        User = get_user_model()
        for username, password, staff in [
            ("demo", os.environ.get("DEMO_PASSWORD", "demo-streamserve"), False),
            ("operator", os.environ.get("OPERATOR_PASSWORD", "operator-streamserve"), True),
        ]:
            user, _ = User.objects.get_or_create(username=username)
            user.set_password(password)
            user.is_staff = user.is_superuser = staff
            user.save()
            role = "staff operator (console, admin)" if staff else "demo user"
            self.stdout.write(f"  {role}: username {username!r}, password {password!r}")
