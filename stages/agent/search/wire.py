"""One page request on the wire, bounded in time, bytes and reach (docs/agent.md "Browsing", Limits and Security).

- **One deadline per page** (`Deadline`): every socket a page opens is registered (httpx's `trace` request
  extension reports each new connection) and shut down when the page's wall-clock limit passes, so a read blocked
  on a server that drips headers or body, or stalls, returns at once; DNS is waited for at most the time left.
- **One resolution per hop, pinned** (`Resolver.pin`): the host name is resolved once, every address it gives must
  be public (unless `allow_private`), and the request is sent to that address, with the Host header and the TLS
  name (SNI and certificate check: httpx's `sni_hostname` extension) kept on the name, as safehttpx does
  (github.com/gradio-app/safehttpx, `AsyncSecureTransport`). Connections are never kept alive: a pooled one must
  not carry another host's request. The fetcher sends through an `httpx.HTTPTransport` itself (no `httpx.Client`:
  it would send a URL's userinfo as Basic auth and parse a `Location` header it is not asked to follow).
- **Bytes on the wire and decoded both capped** (`read_body`): only gzip and deflate are offered
  (`ACCEPT_ENCODING`), the body is read raw and inflated here with zlib's `max_length`, so the decoded size is
  counted as it is produced; brotli, zstd, unknown and stacked encodings (`gzip, gzip`) are refused.
- **URLs** (`parse_url`, `join_location`): http(s) only, userinfo stripped (never sent), fragments dropped; a
  malformed URL or `Location` is `bad_url`, a permanent failure, never a connection error.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

ACCEPT_ENCODING = "gzip, deflate"
_ZLIB_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
MAX_URL_CHARS = 2048


class PageFailure(Exception):
    """Why a page could not be read: `kind` (timeout, too_large, bad_url, blocked_address, ...) and whether the
    network is to blame (`transient`: worth another try)."""

    def __init__(self, kind: str, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.kind, self.transient = kind, transient


class Deadline:
    """A page's wall-clock limit over everything it does. `trace` is handed to httpx as the request's `trace`
    extension: each new TCP connection's socket is watched (through a duplicate descriptor, so a number reused
    after close can never be hit) and shut down at the limit."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        return self.at - time.monotonic()

    def remaining(self) -> float:
        """The time left; a `timeout` failure when none is."""
        left = self.left()
        if left <= 0:
            raise PageFailure("timeout", f"the page's {self.seconds:g} s limit ran out", True)
        return left

    def trace(self, name: str, info: dict[str, Any]) -> None:
        if not name.endswith("connect_tcp.complete"):
            return
        try:
            watched = info["return_value"].get_extra_info("socket").dup()
        except OSError as err:  # out of descriptors: a socket that cannot be watched is not used
            raise PageFailure("connection", f"cannot watch the connection: {err}", True) from err
        with self._lock:
            self._sockets.append(watched)
            if self.expired:
                _shut(watched)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._sockets:
                _shut(sock)

    def close(self) -> None:
        self._timer.cancel()
        with self._lock:
            for sock in self._sockets:
                sock.close()
            self._sockets.clear()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes a recv blocked in another thread; close alone would not
    except OSError:
        pass  # already closed by the peer


def resolve_host(host: str) -> list[str]:
    """The addresses of `host` (IPv4 first: a box without an IPv6 route fails IPv6 at once). One DNS lookup; tests
    replace this function to play a rebinding name server."""
    infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    addresses = list(dict.fromkeys(info[4][0].split("%")[0] for info in infos))
    return sorted(addresses, key=lambda a: ":" in a)


def is_public(address: str) -> bool:
    """Not loopback, private, link-local (cloud metadata: 169.254.169.254), reserved or multicast."""
    ip = ipaddress.ip_address(address)
    return ip.is_global and not ip.is_multicast


def refuse_private(host: str, addresses: list[str]) -> None:
    for address in addresses:
        if not is_public(address):
            raise PageFailure("blocked_address", f"{host} resolves to a non-public address ({address})")


class Resolver:
    """Pins each request to the address its check passed. A lookup runs on its own daemon thread so a page waits
    for it at most its time left (a stuck lookup ends on its own, at the system resolver's timeout, and never
    holds up the interpreter's exit)."""

    def __init__(self, allow_private: bool) -> None:
        self.allow_private = allow_private

    def pin(self, host: str, deadline: Deadline) -> list[str]:
        """The checked addresses to connect to, in order (an address literal: itself)."""
        addresses = [host] if _is_address(host) else self._lookup(host, deadline)
        if not self.allow_private:
            refuse_private(host, addresses)
        return addresses

    @staticmethod
    def _lookup(host: str, deadline: Deadline) -> list[str]:
        answer: list[list[str] | BaseException] = []
        thread = threading.Thread(target=_resolve_into, args=(host, answer), name="dns", daemon=True)
        thread.start()
        thread.join(deadline.remaining())
        if not answer:
            raise PageFailure("timeout", f"no DNS answer for {host} within the page's limit", True)
        if isinstance(answer[0], BaseException):
            raise PageFailure("dns", f"cannot resolve {host}: {answer[0]}", transient=True)
        if not answer[0]:
            raise PageFailure("dns", f"no address for {host}", transient=True)
        return answer[0]


def _resolve_into(host: str, answer: list[list[str] | BaseException]) -> None:
    try:
        answer.append(resolve_host(host))
    except (OSError, UnicodeError) as err:
        answer.append(err)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def parse_url(url: str) -> httpx.URL:
    """A fetchable http(s) URL without userinfo and fragment; `bad_url` otherwise."""
    if len(url) > MAX_URL_CHARS or not url.isprintable() or any(c.isspace() for c in url):
        raise PageFailure("bad_url", f"not a fetchable http(s) URL: {url[:200]!r}")
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, UnicodeError) as err:
        raise PageFailure("bad_url", f"not a fetchable URL: {str(err)[:200]}: {url[:200]!r}") from None
    if parsed.scheme not in ("http", "https") or not parsed.raw_host:
        raise PageFailure("bad_url", f"not a fetchable http(s) URL: {url[:200]!r}")
    return parsed.copy_with(userinfo=b"", fragment=None)


def join_location(base: httpx.URL, location: str) -> httpx.URL:
    """The redirect target; a malformed `Location` (e.g. `http://[::1`) is `bad_url`."""
    try:
        joined = str(base.join(location))
    except (httpx.InvalidURL, ValueError, UnicodeError) as err:
        raise PageFailure("bad_url", f"malformed redirect Location {location[:200]!r}: {str(err)[:100]}") from None
    return parse_url(joined)


@contextmanager
def open_response(transport: httpx.BaseTransport, url: httpx.URL, headers: dict[str, str], deadline: Deadline,
                  resolver: Resolver | None) -> Iterator[httpx.Response]:
    """GET `url` within the deadline; with a `resolver`, sent to the pinned address (module docstring). The next
    checked address is tried when one refuses the connection."""
    host = url.raw_host.decode("ascii")
    addresses = resolver.pin(host, deadline) if resolver is not None else [None]
    for i, address in enumerate(addresses[:3]):
        left = deadline.remaining()
        extensions: dict[str, Any] = {"timeout": {"connect": left, "read": left, "write": left, "pool": left},
                                      "trace": deadline.trace}
        target = url
        if address is not None and address != host:
            target = url.copy_with(host=address)
            extensions["sni_hostname"] = host
        request = httpx.Request("GET", target, headers={**headers, "Host": url.netloc.decode("ascii")},
                                extensions=extensions)
        try:
            response = transport.handle_request(request)
        except httpx.ConnectError:
            if i + 1 >= min(len(addresses), 3):
                raise
            continue
        try:
            yield response
        finally:
            response.close()
        return


class _Identity:
    def feed(self, data: bytes, room: int) -> tuple[bytes, bool]:
        return data[:room], len(data) > room


class _Inflate:
    """zlib with the output bounded per call: what does not fit stays in `unconsumed_tail` (= over the cap)."""

    def __init__(self, wbits: int, raw_fallback: bool) -> None:
        self._wbits, self._fallback, self._started = wbits, raw_fallback, False
        self._z = zlib.decompressobj(wbits)

    def feed(self, data: bytes, room: int) -> tuple[bytes, bool]:
        if room <= 0:  # max_length 0 would mean "no limit"
            return b"", bool(data)
        try:
            out = self._z.decompress(data, room)
        except zlib.error:
            if self._started or not self._fallback:
                raise
            self._z = zlib.decompressobj(-zlib.MAX_WBITS)  # "deflate" sent as a raw stream, as many servers do
            out = self._z.decompress(data, room)
        self._started = True
        return out, bool(self._z.unconsumed_tail)


def _decoder(content_encoding: str) -> _Identity | _Inflate:
    codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip().lower() not in ("", "identity")]
    if not codings:
        return _Identity()
    if len(codings) > 1:
        raise PageFailure("unsupported_encoding", f"stacked content encodings refused: {content_encoding[:100]!r}")
    if codings[0] not in _ZLIB_WBITS:
        raise PageFailure("unsupported_encoding", f"content encoding {codings[0][:40]!r} was not offered "
                          f"(Accept-Encoding: {ACCEPT_ENCODING})")
    return _Inflate(_ZLIB_WBITS[codings[0]], raw_fallback=codings[0] == "deflate")


def read_body(response: httpx.Response, max_bytes: int, deadline: Deadline, cut: bool) -> bytes:
    """Up to `max_bytes` of the decoded body, streamed, with at most `max_bytes` read off the wire; past either:
    cut there (`cut`) or fail as `too_large`. Past the deadline: fail as `timeout`."""
    declared = response.headers.get("content-length", "")
    if not cut and declared.isdigit() and int(declared) > max_bytes:
        raise PageFailure("too_large", f"{declared} bytes declared, over the {max_bytes}-byte cap")
    decoder = _decoder(response.headers.get("content-encoding", ""))
    chunks, size, wire = [], 0, 0
    try:
        for chunk in response.iter_raw():  # as the bytes arrive: a slow drip meets the deadline check
            deadline.remaining()
            wire += len(chunk)
            data, over = decoder.feed(chunk, max_bytes - size)
            chunks.append(data)
            size += len(data)
            if over or wire > max_bytes or size >= max_bytes:
                if not cut:
                    raise PageFailure("too_large", f"more than {max_bytes} bytes (on the wire or decoded)")
                break
    except zlib.error as err:
        raise PageFailure("bad_encoding", f"the {response.headers.get('content-encoding')!r} body does not "
                          f"decode: {err}") from None
    if deadline.expired:  # the shutdown at the deadline ended a body delimited by the connection's close
        deadline.remaining()
    return b"".join(chunks)
