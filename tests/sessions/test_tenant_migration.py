"""Migration 0009 puts the users, sessions and jobs that existed before tenants into the default tenant."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from sessions.models import GenerationSession, Job, Tenant, TenantMembership
from tests.factories import JobFactory, SessionFactory, UserFactory

BEFORE = ("streams", "0008_tenants")
AFTER = ("streams", "0009_default_tenant")


@pytest.mark.django_db(transaction=True)
def test_existing_users_sessions_and_jobs_join_the_default_tenant():
    # Given: a database with the tenant columns but no tenant, one user already a member elsewhere
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes("streams")
    executor.migrate([BEFORE])
    TenantMembership.objects.all().delete()
    Tenant.objects.all().delete()
    alone, elsewhere = UserFactory(), UserFactory()
    vision = Tenant.objects.create(name="vision")
    TenantMembership.objects.create(tenant=vision, user=elsewhere, is_default=True)
    session = SessionFactory(owner=alone, tenant=None)
    job = JobFactory(owner=elsewhere, tenant=None)
    kept = SessionFactory(owner=elsewhere, tenant=vision)

    # When: it migrates
    MigrationExecutor(connection).migrate([AFTER])

    # Then: everyone is a member of the default tenant, the default of those who had none; rows
    # without a tenant are the default tenant's, the others keep theirs
    default = Tenant.objects.get(name=Tenant.DEFAULT_NAME)
    assert TenantMembership.objects.get(user=alone).tenant == default
    assert TenantMembership.objects.get(user=alone).is_default
    assert not TenantMembership.objects.get(user=elsewhere, tenant=default).is_default
    assert TenantMembership.objects.get(user=elsewhere, is_default=True).tenant == vision
    assert GenerationSession.objects.get(pk=session.pk).tenant == default
    assert Job.objects.get(pk=job.pk).tenant == default
    assert GenerationSession.objects.get(pk=kept.pk).tenant == vision
    MigrationExecutor(connection).migrate(latest)
