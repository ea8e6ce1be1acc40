"""The default suite reads no network (docs/testing.md, "Tests that need the network"): inside the test process an
IPv4/IPv6 connect to anything but this machine (loopback) is refused with an error that says how to mark the test,
unless the running test is marked `network` (left out of the default suite) or `registry` (the package registry,
which the install reads anyway). Child processes are not covered: a test that runs a networked command is marked by
hand. Loaded by tests/conftest.py as a plugin."""

from __future__ import annotations

import errno
import ipaddress
import socket

import pytest

ALLOWING_MARKS = ("network", "registry")
_allowed = {"now": False}


def is_local(host: object) -> bool:
    """A loopback address or name: 127.0.0.0/8, ::1, localhost (a connect resolves names itself)."""
    if not isinstance(host, str):
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _refused(sock: socket.socket, address: object) -> bool:
    return (not _allowed["now"] and sock.family in (socket.AF_INET, socket.AF_INET6) and isinstance(address, tuple)
            and not is_local(address[0]))


_real_connect, _real_connect_ex = socket.socket.connect, socket.socket.connect_ex


def _connect(self: socket.socket, address) -> None:
    if _refused(self, address):
        raise OSError(errno.ENETUNREACH, f"the test suite reads no network, and this test connected to {address[0]}:"
                                         f"{address[1]}. Serve it on 127.0.0.1, or mark the test `network` (left out "
                                         "of the default suite) and list it in docs/testing.md")
    return _real_connect(self, address)


def _connect_ex(self: socket.socket, address) -> int:
    return errno.ENETUNREACH if _refused(self, address) else _real_connect_ex(self, address)


socket.socket.connect, socket.socket.connect_ex = _connect, _connect_ex


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _allowed["now"] = any(item.get_closest_marker(mark) for mark in ALLOWING_MARKS)
    try:
        return (yield)
    finally:
        _allowed["now"] = False
