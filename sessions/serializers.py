from __future__ import annotations

from rest_framework import serializers

from sessions.models import ChunkRecord, GenerationSession, Prompt, SessionEvent
from workers.catalog import PRESETS
from workers.runtime.presets import DEFAULT_PRESET


class PromptSerializer(serializers.ModelSerializer):
    class Meta:
        model = Prompt
        fields = ["id", "text", "from_chunk", "created_at"]
        read_only_fields = ["id", "from_chunk", "created_at"]


class PromptCreateSerializer(serializers.Serializer):
    text = serializers.CharField(allow_blank=True, trim_whitespace=False)


class SessionSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username", read_only=True)
    model = serializers.CharField(source="model_name", read_only=True)
    resolution = serializers.CharField(read_only=True)
    worker = serializers.CharField(source="worker.name", read_only=True, default=None)
    host_worker = serializers.CharField(source="host_worker.name", read_only=True, default=None)
    prompt = serializers.SerializerMethodField()

    class Meta:
        model = GenerationSession
        fields = [
            "id",
            "owner",
            "model",
            "resolution",
            "width",
            "height",
            "fps",
            "frames_per_chunk",
            "seed",
            "load",
            "status",
            "activity",
            "state_location",
            "worker",
            "host_worker",
            "epoch",
            "chunks_generated",
            "queue_position",
            "prompt",
            "created_at",
            "last_active_at",
            "terminated_at",
        ]
        read_only_fields = fields

    def get_prompt(self, obj: GenerationSession) -> str | None:
        prompt = obj.prompt_at(obj.chunks_generated)
        return prompt.text if prompt else None


class SessionCreateSerializer(serializers.Serializer):
    """Field types only; domain validation (catalogue, lengths) lives in ``session_spec_build``."""

    prompt = serializers.CharField(allow_blank=True, trim_whitespace=False)
    model = serializers.ChoiceField(choices=sorted(PRESETS), default=DEFAULT_PRESET)
    resolution = serializers.CharField(required=False, allow_blank=False)
    seed = serializers.IntegerField(required=False, min_value=0, max_value=2**63 - 1)


class ChunkRecordSerializer(serializers.ModelSerializer):
    worker = serializers.CharField(source="worker.name", read_only=True, default=None)

    class Meta:
        model = ChunkRecord
        fields = ["chunk_index", "worker", "batch_size", "generation_ms", "delivery_ms", "created_at"]


class SessionEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = SessionEvent
        fields = ["id", "kind", "at", "detail"]
