from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from tests.factories import StaffFactory, UserFactory


@pytest.fixture
def user(db):
    return UserFactory()


@pytest.fixture
def other_user(db):
    return UserFactory()


@pytest.fixture
def staff(db):
    return StaffFactory()


@pytest.fixture
def api():
    return APIClient()


@pytest.fixture
def user_api(user):
    client = APIClient()
    client.force_authenticate(user)
    return client


@pytest.fixture
def staff_api(staff):
    client = APIClient()
    client.force_authenticate(staff)
    return client
