"""The operator console and the audit page in Chromium."""

from __future__ import annotations

import csv
import io
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
from django.contrib.admin.models import LogEntry
from django.test import Client
from django.utils import timezone
from playwright.sync_api import expect

from gpu.models import GpuWorker, Region
from scheduling.models import Migration, ScalingAction, SchedulerConfig, SchedulerDecision
from sessions.models import ChunkRecord
from tests.browser.conftest import PHONE, log_in, screenshot
from tests.factories import GpuWorkerFactory, JobFactory, SessionFactory, StaffFactory, UserFactory

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

LAST_ACTIVE = "() => { const h = window.streamserveConsole.history.active; return h[h.length - 1]; }"
CHART_LAST_ACTIVE = (
    "() => { const d = window.streamserveConsole.charts.sessions.data[1]; return d[d.length - 1]; }"
)


def test_console_shows_workers_updates_live_and_records_actions(browser_context, asgi_server, page_problems):
    staff = StaffFactory(username="operator")
    ready = GpuWorkerFactory(
        name="gpu-a",
        gpu_type="h100",
        capacity=4,
        utilization_pct=63.0,
        memory_bytes=80 * 2**30,
        memory_used_bytes=31 * 2**30,
        power_watts=412.0,
        temperature_c=61.0,
    )
    GpuWorkerFactory(name="gpu-b", gpu_type="l4", status=GpuWorker.Status.PROVISIONING, ready_at=None)
    SchedulerDecision.objects.create(
        trigger="arrive",
        decided_at=timezone.now(),
        policy="turboserve",
        active_sessions=0,
        budget=2,
        target_budget=3,
        duration_ms=1.2,
    )
    log_in(browser_context, asgi_server, staff)
    page = browser_context.new_page()
    page_problems.watch(page)
    page.goto("/console/")

    cards = page.locator(".worker-card")
    expect(cards).to_have_count(2)
    expect(cards.nth(0)).to_contain_text("gpu-a")
    expect(cards.nth(0)).to_contain_text("63 %")
    expect(cards.nth(0)).to_contain_text("412 W")
    expect(cards.nth(1)).to_contain_text("Provisioning")
    expect(cards.nth(0)).to_contain_text("EDC (whole pipeline)")  # its stage role (docs/stages.md)
    expect(cards.nth(1).get_by_role("button", name="Drain gpu-b")).to_be_hidden()
    expect(page.locator("#console-connection")).to_have_text("Live")
    expect(page.locator("#stat-budget")).to_have_text("2 / 3")
    assert page.evaluate(LAST_ACTIVE) == 0

    # Sessions start on gpu-a: the pushed snapshots move the counters, the card and the chart.
    sessions = [SessionFactory(status="executing", worker=ready, state_location="worker") for _ in range(3)]
    expect(page.locator("#stat-active")).to_have_text("3")
    page.wait_for_function(f"({CHART_LAST_ACTIVE})() === 3")
    expect(cards.nth(0)).to_contain_text("3 executing")
    expect(cards.nth(0)).to_contain_text("3 / 4")

    # One-shot jobs: per worker on its card, per state in the jobs table.
    JobFactory(state="running", worker=ready, steps_done=1, owner=staff)
    JobFactory(owner=staff)
    expect(cards.nth(0)).to_contain_text("jobs: 1 running, 0 paused")
    expect(page.locator("#job-counts")).to_contain_text("1 queued · 1 running · 0 paused")
    expect(page.locator("#job-rows tr")).to_have_count(2)
    expect(page.locator("#job-rows")).to_contain_text("running 1/4")
    expect(page.locator("#job-rows")).to_contain_text("queued #1")
    expect(page.locator("#session-rows tr")).to_have_count(3)
    # One region (the local one, no row): both GPUs, the three sessions' load on gpu-a's slots.
    region = page.locator("#region-rows tr")
    expect(region).to_have_count(1)
    expect(region).to_contain_text("local")
    expect(region).to_contain_text("h100 1, l4 1")
    expect(region).to_contain_text("3 / 4")
    # A running session's move from east to west (last hour): out / in, and saving against switching cost.
    east, west = Region.objects.create(name="east", rtt_ms={}), Region.objects.create(name="west", rtt_ms={})
    Migration.objects.create(
        session=sessions[1], source=ready, target=GpuWorker.objects.get(name="gpu-b"), reason="cross-region",
        cross_region=True, source_region=east, target_region=west, started_at=timezone.now(),
        estimated_saving_ms=30252.0, switch_cost_ms=29.3,
    )  # fmt: skip
    expect(region).to_have_count(3)
    expect(page.locator("#region-rows tr", has_text="east")).to_contain_text("1 / 0")
    expect(page.locator("#region-rows tr", has_text="east")).to_contain_text("30252 / 29.3 ms")
    expect(page.locator("#region-rows tr", has_text="west")).to_contain_text("0 / 1")
    expect(page.locator("#region-rows tr", has_text="local")).to_contain_text("0 / 0")
    points = page.evaluate("window.streamserveConsole.history.t.length")
    assert points >= 2

    # Recent chunks show as latency against the SLO.
    now = timezone.now()
    ChunkRecord.objects.bulk_create(
        ChunkRecord(
            session=sessions[0], chunk_index=i, worker=ready, batch_size=3, generation_ms=ms, created_at=now
        )
        for i, ms in enumerate([300.0, 320.0, 1450.0])
    )
    expect(page.locator("#stat-worst")).to_have_text("1.45 s")

    # Set the autoscaler bounds and target utilisation: saved and in the audit trail.
    page.get_by_label("Min GPUs").fill("2")
    page.get_by_label("Max GPUs").fill("1")
    page.get_by_role("button", name="Save").click()
    expect(page.locator("#cfg-max_gpus-error")).to_contain_text("at least min_gpus")
    page.get_by_label("Max GPUs").fill("6")
    page.get_by_label("Target utilisation").fill("0.75")
    page.get_by_role("button", name="Save").click()
    expect(page.locator("#config-status")).to_contain_text("Saved: 2–6 GPUs")
    config = SchedulerConfig.load()
    assert (config.min_gpus, config.max_gpus, config.target_utilization) == (2, 6, 0.75)
    expect(page.locator("#timeline li[data-kind='operator']").first).to_contain_text("max_gpus")

    # Drain gpu-a and terminate a session from the console.
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Drain gpu-a").click()
    expect(cards.nth(0)).to_contain_text("Draining")
    ready.refresh_from_db()
    assert ready.status == GpuWorker.Status.DRAINING
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name=f"Terminate session {str(sessions[0].pk)[:8]}").click()
    expect(page.locator("#session-rows tr")).to_have_count(2)
    sessions[0].refresh_from_db()
    assert sessions[0].status == "terminated"
    assert LogEntry.objects.filter(user=staff).count() == 3  # config, drain, terminate
    expect(page.locator("#timeline li[data-kind='operator']")).to_have_count(3)
    screenshot(page, "console")

    page.set_viewport_size(PHONE)
    # The charts follow their containers through a ResizeObserver: wait for the resize, then nothing
    # may stick out sideways.
    page.wait_for_function(f"document.documentElement.scrollWidth <= {PHONE['width']}")
    screenshot(page, "console-phone")
    page_problems.assert_clean()


def test_console_is_staff_only_in_the_browser(browser_context, asgi_server):
    log_in(browser_context, asgi_server, UserFactory(username="not-staff"))
    page = browser_context.new_page()
    response = page.goto("/console/")
    assert response.status == 403
    expect(page.get_by_role("heading", level=1)).to_have_text("You don't have access to this page")


def _csv_download(page, link_name: str) -> tuple[str, list[dict]]:
    with page.expect_download() as download_info:
        page.get_by_role("link", name=link_name).click()
    download = download_info.value
    text = Path(download.path()).read_text(encoding="utf-8")
    return download.url, list(csv.DictReader(io.StringIO(text)))


def test_audit_page_totals_and_csv_exports_match_the_api(browser_context, asgi_server, page_problems):
    staff = StaffFactory(username="auditor")
    now = timezone.now().replace(second=0, microsecond=0)
    # Released workers: their whole billed life is closed, so the ledger cannot grow during the test.
    h100 = GpuWorkerFactory(
        name="gpu-h100",
        gpu_type="h100",
        price_per_hour=Decimal("3.60"),
        status=GpuWorker.Status.RELEASED,
        requested_at=now - timedelta(minutes=40),
        ready_at=now - timedelta(minutes=39),
        released_at=now - timedelta(minutes=10, seconds=30),
    )
    GpuWorkerFactory(
        name="gpu-l4",
        gpu_type="l4",
        price_per_hour=Decimal("0.80"),
        status=GpuWorker.Status.RELEASED,
        requested_at=now - timedelta(minutes=25),
        ready_at=now - timedelta(minutes=24),
        released_at=now - timedelta(minutes=5),
    )
    session = SessionFactory()
    ChunkRecord.objects.bulk_create(
        ChunkRecord(
            session=session,
            chunk_index=i,
            worker=h100,
            batch_size=2,
            generation_ms=200.0 + 40 * i,
            created_at=now - timedelta(minutes=30 - i),
        )
        for i in range(20)
    )
    other = GpuWorkerFactory(
        name="gpu-x",
        gpu_type="h100",
        status=GpuWorker.Status.RELEASED,
        requested_at=now - timedelta(minutes=50),
        ready_at=now - timedelta(minutes=49),
        released_at=now - timedelta(minutes=45),
    )
    Migration.objects.create(
        session=session,
        source=h100,
        target=other,
        reason="rebalance",
        outcome="succeeded",
        started_at=now - timedelta(minutes=20),
        finished_at=now - timedelta(minutes=20),
    )
    for minutes, direction, budgets in ((35, "out", (1, 2)), (12, "in", (2, 1))):
        ScalingAction.objects.create(
            created_at=now - timedelta(minutes=minutes),
            direction=direction,
            from_budget=budgets[0],
            to_budget=budgets[1],
            reason="test",
        )
    ScalingAction.objects.create(
        created_at=now - timedelta(days=3),
        direction="out",
        from_budget=1,
        to_budget=2,
        reason="outside the range",
    )

    for state, late in (("done", False), ("failed", False), ("done", True)):
        submitted = now - timedelta(minutes=22)
        JobFactory(
            state=state,
            submitted_at=submitted,
            started_at=submitted + timedelta(seconds=5),
            finished_at=submitted + timedelta(seconds=60),
            deadline=submitted + timedelta(seconds=30 if late else 90),
            result="jobs/x.png" if state == "done" else "",
        )

    log_in(browser_context, asgi_server, staff)
    page = browser_context.new_page()
    page_problems.watch(page)
    page.goto("/console/audit/")
    page.get_by_role("button", name="Last 24 h").click()
    expect(page.locator("#total-scaling")).to_have_text("2")
    expect(page.locator("#total-migrations")).to_have_text("1")
    expect(page.locator("#total-chunks")).to_have_text("20")
    expect(page.locator("#bytype-rows tr")).to_have_count(2)
    expect(page.locator("#byregion-rows tr")).to_have_count(1)  # no region rows: all local
    expect(page.locator("#byregion-rows")).to_contain_text("local")
    expect(page.locator("#latency-region-rows tr")).to_have_count(1)
    expect(page.locator("#latency-region-rows th")).to_have_text("local")
    expect(page.locator("#latency-region-rows td").first).to_have_text("20")

    cost_url, cost_rows = _csv_download(page, "Cost CSV (per bucket, GPU type and region)")
    latency_url, latency_rows = _csv_download(page, "Latency CSV (per bucket and region)")
    _, job_rows = _csv_download(page, "Jobs CSV (per bucket)")
    expect(page.locator("#jobs-totals")).to_have_text("(3 ended, SLO met 33.3 %)")
    assert [(r["count"], r["done"], r["slo_met"]) for r in job_rows] == [("3", "2", "1")]

    # The API's own totals for the very same query.
    api = Client()
    api.force_login(staff)
    query = {k: v[0] for k, v in parse_qs(urlparse(cost_url).query).items() if k != "format"}
    cost_api = api.get("/api/audit/cost/", query).json()
    latency_api = api.get("/api/audit/latency/", query).json()

    csv_seconds = sum(float(r["gpu_seconds"]) for r in cost_rows)
    csv_cost = sum(Decimal(r["cost_usd"]) for r in cost_rows)
    assert {r["gpu_type"] for r in cost_rows} == {"h100", "l4"}
    assert csv_seconds == pytest.approx(cost_api["totals"]["gpu_seconds"])
    assert float(csv_cost) == pytest.approx(float(cost_api["totals"]["cost_usd"]))
    # 29.5 + 5 min of H100 and 20 min of L4, billed from the provisioning request to the release.
    assert csv_seconds == pytest.approx((29.5 + 5 + 20) * 60)
    assert sum(int(r["count"]) for r in latency_rows) == latency_api["totals"]["count"] == 20
    assert parse_qs(urlparse(latency_url).query)["start"] == [query["start"]]

    # And the page shows the same totals.
    shown = page.locator("#total-gpu-hours")
    assert float(shown.get_attribute("data-gpu-seconds")) == pytest.approx(csv_seconds)
    expect(page.locator("#total-cost")).to_have_text(f"${float(csv_cost):.2f}")
    page.get_by_role("button", name="Last hour").click()
    expect(page.locator("#range-bucket")).to_have_value("minute")
    expect(page.locator("#latency-rows tr")).to_have_count(20)
    screenshot(page, "audit")

    # A reversed range is refused on the page before any request.
    page.get_by_label("From (local time)").fill("2030-01-02T00:00")
    page.get_by_label("To (local time)").fill("2030-01-01T00:00")
    page.get_by_role("button", name="Show").click()
    expect(page.locator("#range-end-error")).to_have_text("must be after the start")
    page_problems.assert_clean()


def test_audit_page_shows_fractions_of_a_cent_and_distinct_cost_ticks(
    browser_context, asgi_server, page_problems
):
    # given one released L4 minute at $0.12/h: $0.002 of GPU cost, in one minute bucket
    staff = StaffFactory(username="penny")
    now = timezone.now().replace(second=0, microsecond=0)
    GpuWorkerFactory(
        name="gpu-cheap",
        gpu_type="l4",
        price_per_hour=Decimal("0.12"),
        status=GpuWorker.Status.RELEASED,
        requested_at=now - timedelta(minutes=10),
        ready_at=now - timedelta(minutes=10),
        released_at=now - timedelta(minutes=9),
    )
    log_in(browser_context, asgi_server, staff)
    page = browser_context.new_page()
    page_problems.watch(page)

    # when the audit page shows the last hour
    page.goto("/console/audit/")
    page.get_by_role("button", name="Last hour").click()

    # then the cost reads $0.002 (not $0.00) in the totals and the GPU-type row
    expect(page.locator("#total-cost")).to_have_text("$0.002")
    expect(page.locator("#bytype-rows td").nth(1)).to_have_text("$0.002")
    # and the cost axis labels (uPlot's drawn labels) are all different, in steps of a fraction of a cent
    ticks = page.evaluate("() => window.streamserveAudit.charts.cost.axes[1]._values")
    assert len(ticks) >= 3
    assert len(set(ticks)) == len(ticks)
    assert all(len(tick.split(".")[1]) >= 3 for tick in ticks), ticks
    page_problems.assert_clean()
