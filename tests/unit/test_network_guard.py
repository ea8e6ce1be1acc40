"""tests/network_guard.py: inside the test process, a connect beyond this machine is refused with the fix, and the
loopback stays open (docs/testing.md, "Tests that need the network")."""

from __future__ import annotations

import errno
import socket

import pytest

from tests.network_guard import is_local


def test_loopback_names_and_addresses_are_local() -> None:
    assert all(is_local(host) for host in ("127.0.0.1", "127.3.2.1", "::1", "localhost", "api.localhost"))
    assert not any(is_local(host) for host in ("10.0.0.1", "192.168.1.2", "8.8.8.8", "::ffff:8.8.8.8",
                                               "pypi.org", "example.invalid", "", None))


def test_a_connect_beyond_this_machine_is_refused_before_any_packet() -> None:
    # a name under .invalid never resolves, so even a broken guard would send nothing anywhere
    with socket.socket() as sock, pytest.raises(OSError, match=r"reads no network.*mark the test `network`") as info:
        sock.connect(("arpo-test.invalid", 443))
    assert info.value.errno == errno.ENETUNREACH
    with socket.socket() as sock:
        assert sock.connect_ex(("arpo-test.invalid", 443)) == errno.ENETUNREACH


def test_the_loopback_stays_open() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.socket() as client:
            client.connect(server.getsockname())
            accepted, _ = server.accept()
            accepted.close()
