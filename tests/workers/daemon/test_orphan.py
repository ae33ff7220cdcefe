"""When a worker counts its control plane as lost (``workers.daemon.orphan``), on a fake clock."""

from __future__ import annotations

from workers.daemon.orphan import OrphanWatch


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_silence_longer_than_the_timeout_is_lost_and_a_command_or_a_new_acknowledgement_is_contact():
    clock = Clock()
    watch = OrphanWatch(timeout_s=10, clock=clock)
    # a whole timeout of grace from the start
    clock.now += 10
    assert not watch.lost()
    clock.now += 0.5
    assert watch.lost()
    # a command is contact
    watch.heard()
    assert not watch.lost()
    # a new acknowledgement is contact; the same value read again is not
    watch.acknowledgement(b"1")
    clock.now += 8
    watch.acknowledgement(b"1")
    clock.now += 3
    assert watch.lost()
    watch.acknowledgement(b"2")
    assert not watch.lost() and watch.silent_s() == 0
    # nothing read (Redis answered no key) is no contact
    clock.now += 11
    watch.acknowledgement(None)
    assert watch.lost()


def test_a_zero_timeout_never_declares_the_control_plane_lost():
    clock = Clock()
    watch = OrphanWatch(timeout_s=0, clock=clock)
    clock.now += 1e6
    assert not watch.lost()
