"""The generation page when WebRTC's media process is not running (``WEBRTC_MEDIA=process`` and no
``manage.py runmedia`` beside the server): the offer is answered with an error frame at once, and the
page falls back to the socket, whose stream carries on. This module starts no media process."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.browser.test_generate_page import _watch_executing_session
from tests.browser.test_webrtc_page import _send

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_without_a_media_process_the_page_falls_back_to_the_socket(
    browser_context, asgi_server, worker_stand_in, page_problems
):
    # Given a viewer that picked WebRTC, and no media process to serve it
    session, page = _watch_executing_session(
        browser_context, asgi_server, page_problems, username="rtc-nomedia", url="&codec=webrtc"
    )

    # Then the page says why and carries on over the socket, through MSE
    expect(page.locator("#stat-codec")).to_have_text("H.264 (MSE)")
    expect(page.locator("#codec-note")).to_contain_text("WebRTC failed")
    expect(page.locator("#page-message")).to_contain_text("no media process")
    expect(page.locator("#connection-state")).to_have_text("Live")
    _send(worker_stand_in, session, 0, 1)
    page.wait_for_function("document.getElementById('mse-video').dataset.chunk === '0'")
    page_problems.assert_clean()
