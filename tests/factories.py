from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import factory
from django.contrib.auth import get_user_model
from django.utils import timezone

from gpu.models import GpuWorker
from sessions.models import ChunkRecord, GenerationSession, Job, Prompt


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ["username"]

    username = factory.Sequence(lambda n: f"user{n}")
    password = factory.django.Password("pw-for-tests-1")


class StaffFactory(UserFactory):
    is_staff = True
    username = factory.Sequence(lambda n: f"staff{n}")


class GpuWorkerFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = GpuWorker

    name = factory.Sequence(lambda n: f"worker-{n}")
    gpu_type = "h100"
    capacity = 4
    price_per_hour = Decimal("3.6000")
    status = GpuWorker.Status.READY
    requested_at = factory.LazyFunction(lambda: timezone.now() - timedelta(minutes=5))
    ready_at = factory.LazyAttribute(lambda o: o.requested_at + timedelta(seconds=30))


class SessionFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = GenerationSession
        skip_postgeneration_save = True

    owner = factory.SubFactory(UserFactory)
    model_name = "tiny"
    width = 64
    height = 64
    fps = 8
    frames_per_chunk = 4
    seed = factory.Sequence(lambda n: n)
    status = GenerationSession.Status.QUEUED

    @factory.post_generation
    def prompt(self, create, extracted, **kwargs):
        if create:
            Prompt.objects.create(session=self, text=extracted or "a red fox in the snow", from_chunk=0)


class ChunkRecordFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ChunkRecord

    session = factory.SubFactory(SessionFactory)
    chunk_index = factory.Sequence(lambda n: n)
    worker = factory.SubFactory(GpuWorkerFactory)
    batch_size = 1
    generation_ms = 100.0
    created_at = factory.LazyFunction(timezone.now)


class JobFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Job

    owner = factory.SubFactory(UserFactory)
    kind = Job.Kind.IMAGE
    prompt = "a red fox in the snow"
    model_name = "tiny"
    width = 64
    height = 64
    frames = 1
    steps = 4
    seed = factory.Sequence(lambda n: n)
    submitted_at = factory.LazyFunction(timezone.now)
    deadline = factory.LazyAttribute(lambda o: o.submitted_at + timedelta(seconds=60))
