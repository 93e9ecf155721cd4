"""Length headers a client gets wrong are its error (400, in the route's error shape), never
the server's: `Inference-Header-Content-Length` on the Open Inference Protocol, and
`Content-Length` wherever a body is read.

The requests go over a raw socket, byte for byte as written here: HTTP clients refuse to
send, or rewrite, the malformed values under test.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from starlette.types import Message

from api.http.app import create_app
from tests.support.in_process import make_settings, spec_for
from tests.support.server_process import ServerProcess, run_server
from tests.support.tiny_models import TinyModel, tiny_models_file

OIP_INFER = "/v2/models/tiny/infer"
OIP_BODY = json.dumps(
    {"inputs": [{"name": "input-0", "shape": [1], "datatype": "BYTES", "data": ["free prize"]}]}
).encode()
# Each a value `str.isdigit()` + `int()` mishandled or that is no length at all: '²' (as the
# one Latin-1 byte HTTP carries it in), '٣' (Arabic-Indic three, as UTF-8), 5,000 digits
# (past `int()`'s limit), signed, spaced, empty, hexadecimal, and 25 digits.
MALFORMED = [
    b"\xb2",
    "٣".encode(),
    b"1" * 5000,
    b"-1",
    b"+5",
    b"1 2",
    b"",
    b"0x10",
    b"9" * 25,
]
IDS = ["superscript-two", "arabic-indic-three", "5000-digits", "negative", "plus", "spaced",
       "empty", "hex", "25-digits"]  # fmt: skip


@dataclass(frozen=True)
class RawAnswer:
    status: int
    headers: dict[str, str]
    body: bytes


def send_raw(url: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> RawAnswer:
    """One HTTP/1.1 POST with exactly these header bytes; the connection is closed after."""
    host, port = url.removeprefix("http://").split(":")
    request = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n".encode()
    request += b"Content-Type: application/json\r\n"
    request += b"".join(name + b": " + value + b"\r\n" for name, value in headers)
    request += b"\r\n" + body
    received = b""
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        while chunk := sock.recv(65536):
            received += chunk
    head, _, content = received.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines)
    headers = {name.lower(): value for name, value in fields.items()}
    return RawAnswer(int(status_line.split()[1]), headers, content)


@pytest.fixture(scope="module")
def server(
    tiny_bert: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("lengths")
    env = {"MODELS_FILE": str(tiny_models_file(folder, tiny_bert, adapters=("spam",)))}
    with run_server(env, folder) as process:
        process.wait_ready()
        yield process


@pytest.mark.parametrize("value", MALFORMED, ids=IDS)
def test_a_malformed_inference_header_length_is_a_400_in_the_protocols_shape(
    server: ServerProcess, value: bytes
) -> None:
    answer = send_raw(
        server.url,
        OIP_INFER,
        [
            (b"Inference-Header-Content-Length", value),
            (b"Content-Length", str(len(OIP_BODY)).encode()),
        ],
        OIP_BODY,
    )

    assert answer.status == 400, answer
    error = json.loads(answer.body)["error"]
    assert isinstance(error, str) and "Inference-Header-Content-Length" in error
    assert server.process.poll() is None


def test_a_well_formed_inference_header_length_still_splits_the_body(
    server: ServerProcess,
) -> None:
    binary = b"\x00" * 3  # bytes after the JSON header that no input claims
    answer = send_raw(
        server.url,
        OIP_INFER,
        [
            (b"Inference-Header-Content-Length", str(len(OIP_BODY)).encode()),
            (b"Content-Length", str(len(OIP_BODY) + len(binary)).encode()),
        ],
        OIP_BODY + binary,
    )
    assert answer.status == 400  # read as the header it says, then the stray bytes refused
    assert "binary_data_size" in json.loads(answer.body)["error"]
    exact = send_raw(
        server.url,
        OIP_INFER,
        [
            (b"Inference-Header-Content-Length", str(len(OIP_BODY)).encode()),
            (b"Content-Length", str(len(OIP_BODY)).encode()),
        ],
        OIP_BODY,
    )
    assert exact.status == 200, exact


@pytest.mark.parametrize("path", ["/predict", OIP_INFER])
@pytest.mark.parametrize("value", [v for v in MALFORMED if v], ids=IDS[:6] + IDS[7:])
def test_a_malformed_content_length_is_a_400_and_the_server_carries_on(
    server: ServerProcess, path: str, value: bytes
) -> None:
    """uvicorn's HTTP parser refuses these itself, before the app, in its own words."""
    answer = send_raw(server.url, path, [(b"Content-Length", value)], b'{"inputs": "hi"}')

    assert answer.status == 400, answer
    assert server.process.poll() is None
    ok = httpx.post(f"{server.url}/predict", json={"inputs": "free prize", "model": "tiny"})
    assert ok.status_code == 200


def call_app(app: object, path: str, content_length: bytes) -> tuple[int, object]:
    """The app's answer to a POST whose Content-Length is `content_length`, through its
    middleware stack, as an ASGI server that passes the header on unchecked would call it."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"test"), (b"content-length", content_length)],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b'{"inputs": "hi"}', "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))  # type: ignore[operator]
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(body)


@pytest.mark.parametrize(
    "value",
    [b"1" * 5000, b"9" * 25, b"\xb2", b"-1"],
    ids=["5000-digits", "25-digits", "superscript-two", "negative"],
)
def test_the_body_limit_answers_a_malformed_content_length_with_the_routes_400(
    tiny_bert: TinyModel, value: bytes
) -> None:
    app = create_app(make_settings(), [spec_for(tiny_bert)])

    status, body = call_app(app, "/predict", value)
    assert status == 400
    assert body == {"error": {"code": "bad_request", "message": "Content-Length: not a length"}}
    status, body = call_app(app, OIP_INFER, value)
    assert (status, body) == (400, {"error": "Content-Length: not a length"})
