"""Fast scale-out on the live platform (BlitzScale): a new worker's weights come from a peer GPU.

The platform starts with one worker, which loads the preset's weights from local storage and
registers them in the parameter pool. Load arrives; the autoscaler scales out; the scaler plans the
new worker's load over the pool (a chain from the serving worker) before the process starts; the
new worker pulls every block from its peer, verifies it, reports its phases and becomes ready; the
scheduler places sessions on it. The test checks the recorded source, the plan, the phases, and that
the weights the new worker holds are bit-identical to its source's, block by block (each block's
checksum recomputed from the bytes each worker actually serves).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from gpu.models import GpuWorker, WeightHolding
from scheduling.models import ScalingAction
from sessions.models import GenerationSession
from tests.e2e.conftest import wait_for
from tests.factories import StaffFactory, UserFactory
from workers.runtime.weights import read_manifest, weights_receive
from workers.runtime.weights.manifest import checksum

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db]


@pytest.fixture(scope="module")
def tokens(platform, django_db_blocker):
    from rest_framework.authtoken.models import Token

    with django_db_blocker.unblock():
        return {
            "user": Token.objects.create(user=UserFactory()).key,
            "staff": Token.objects.create(user=StaffFactory()).key,
        }


def api(platform, token):
    return httpx.Client(base_url=platform.url, headers={"Authorization": f"Token {token}"}, timeout=30)


def served_block_checksums(manifest, address: str) -> list[str]:
    """Pull every block from one holder and checksum the bytes received (not the manifest's)."""
    result = weights_receive(manifest, sources=[address], device="cpu", timeout_s=120)
    assert result.source == address, result.attempts
    return [checksum(buffer) for buffer in result.packed.buffers]


def test_scale_out_under_load_loads_the_new_worker_from_a_peer(platform, tokens, live_db):
    # given the platform's first worker serving, its weights complete in the pool (from disk)
    first = wait_for(
        lambda: GpuWorker.objects.filter(status="ready").first(), 120, message="the first worker"
    )
    assert first.weights_source in ("disk", "init"), first.weights_source
    source_holding = wait_for(
        lambda: WeightHolding.objects.filter(worker=first, state="complete").first(),
        30,
        message="the first worker's weights in the pool",
    )
    with api(platform, tokens["staff"]) as staff:
        assert staff.patch("/api/scheduler/config/", json={"max_gpus": 2}).status_code == 200
    # when load arrives (more active sessions than one worker holds at the target utilisation)
    with api(platform, tokens["user"]) as client:
        for i in range(3):
            response = client.post(
                "/api/sessions/", json={"prompt": f"crowd {i}", "model": "tiny", "seed": 7 + i}
            )
            assert response.status_code == 201, response.text
    new = wait_for(
        lambda: GpuWorker.objects.filter(status="ready").exclude(pk=first.pk).first(),
        180,
        message="a second worker ready",
    )
    # then the scale-out's plan chained it from the serving worker, before it started
    action = ScalingAction.objects.get(direction="out", workers=new)
    chain = next(c for c in action.plan["chains"] if new.name in c["targets"])
    assert chain["source"] == first.name and chain["source_kind"] == "gpu", action.plan
    assert new.weights_plan["chain"][0] == first.name and new.expected_ready_at is not None
    # and its weights came from that peer: recorded on the worker and on the action
    assert new.weights_source == "peer", (new.weights_source, new.weights_source_detail, platform.logs())
    assert first.name in new.weights_source_detail
    wait_for(
        lambda: ScalingAction.objects.get(pk=action.pk).ready_at is not None, 30, message="the action done"
    )
    action.refresh_from_db()
    phases = action.phases[new.name]
    assert phases["source"] == "peer" and {"process_up", "weights_complete", "ready"} <= set(phases)
    assert new.requested_at <= new.process_up_at <= new.weights_complete_at <= new.ready_at
    # and the bytes it holds are the source's, block by block
    new_holding = WeightHolding.objects.get(worker=new, state="complete")
    assert new_holding.digest == source_holding.digest
    manifest = read_manifest(Path(platform.env["WEIGHTS_DIR"]) / "tiny.safetensors")
    assert manifest.weights_id == source_holding.digest
    from_source = served_block_checksums(manifest, source_holding.address)
    from_new = served_block_checksums(manifest, new_holding.address)
    assert from_new == from_source == [block.checksum for block in manifest.blocks]
    # and the scheduler put sessions on it once it was ready
    wait_for(
        lambda: GenerationSession.objects.filter(worker=new, status="executing").exists(),
        60,
        message="a session placed on the new worker",
    )
