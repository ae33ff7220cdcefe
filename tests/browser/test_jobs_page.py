"""The jobs page in Chromium: submit an image/video job, see it queued with its place in line, follow
its progress over the socket, cancel it; a bad request shows the field's error."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from sessions.models import Job
from tests.browser.conftest import log_in, screenshot
from tests.factories import GpuWorkerFactory, UserFactory

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_submit_a_video_job_see_it_queued_follow_it_and_cancel_it(
    browser_context, asgi_server, worker_stand_in, page_problems
):
    user = UserFactory(username="painter")
    log_in(browser_context, asgi_server, user)
    page = browser_context.new_page()
    page_problems.watch(page)
    page.goto("/")
    page.get_by_role("link", name="Images & videos").click()
    expect(page.get_by_role("heading", name="Your images and videos")).to_be_visible()
    expect(page.get_by_role("button", name="Submit")).to_be_enabled()
    expect(page.locator("#connection-state")).to_have_text("Live")

    # A bad request: the API's 400 shows next to the field it names.
    page.get_by_role("radio", name="Video").check()
    page.get_by_label("Frames").fill("1")
    page.get_by_role("button", name="Submit").click()
    expect(page.locator("#job-frames-error")).to_contain_text("a video has between 2 and")
    expect(page.locator("#job-frames")).to_have_attribute("aria-invalid", "true")
    assert not Job.objects.exists()

    page.get_by_label("Frames").fill("8")
    page.get_by_label("Prompt", exact=True).fill("a green square moving left")
    page.get_by_role("button", name="Submit").click()
    card = page.locator("#gallery li.job")
    expect(card).to_have_count(1)
    expect(card.locator(".badge")).to_have_text("Queued — #1 in line")
    job = Job.objects.get()
    assert (job.owner, job.kind, job.frames, job.model_name, job.state) == (
        user,
        "video",
        8,
        "tiny",
        "queued",
    )
    expect(card).to_contain_text("a green square moving left")
    screenshot(page, "jobs")

    # The dispatcher's decision and a worker's progress, as the control plane broadcasts them.
    gpu = GpuWorkerFactory(name="gpu-j", model_preset="tiny")
    Job.objects.filter(pk=job.pk).update(state="running", worker=gpu, epoch=1, steps_done=2)
    job.refresh_from_db()
    worker_stand_in.job(job)
    expect(card.locator(".badge")).to_have_text(f"Running — step 2 of {job.steps}")
    expect(card.locator("progress")).to_have_attribute("value", "2")
    # A description older than what the page shows (broadcasts from several processes arrive out of
    # order: issue 32's image showed "step 0 of 4" once done) does not undo the progress; a newer one does
    worker_stand_in.job(job, step=0)
    page.wait_for_timeout(300)
    expect(card.locator(".badge")).to_have_text(f"Running — step 2 of {job.steps}")
    worker_stand_in.job(job, step=3)
    expect(card.locator(".badge")).to_have_text(f"Running — step 3 of {job.steps}")

    card.get_by_role("button", name="Cancel").click()
    expect(card.locator(".badge")).to_have_text("Cancelled")
    job.refresh_from_db()
    assert job.state == "cancelled"
    # A second job goes on top, before and after a reload (newest first).
    page.get_by_role("radio", name="Image").check()
    page.get_by_label("Prompt", exact=True).fill("a blue circle")
    page.get_by_role("button", name="Submit").click()
    expect(page.locator("#gallery li.job")).to_have_count(2)
    for _ in range(2):
        expect(page.locator("#gallery li.job").first).to_contain_text("a blue circle")
        expect(page.locator("#gallery li.job").nth(1).locator(".badge")).to_have_text("Cancelled")
        page.reload()
    page_problems.assert_clean()
