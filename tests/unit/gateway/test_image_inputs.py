"""Images in the embedding routes' bodies (`gateway.calls.image_inputs`): which strings are
images, data URIs decoded or refused with a message that says what to fix, vLLM's messages,
text-only models, and URLs fetched only from listed hosts (from a real local HTTP server)."""

from __future__ import annotations

import asyncio
import base64
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gateway.calls.image_inputs import (
    ImageRules,
    ImageUrl,
    decode_data_uri,
    fetch_images,
    has_images,
    input_items,
    messages_item,
    url_items,
    with_stand_ins,
)
from tasks.errors import ShoalError

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(40))  # the worker decodes; here bytes are bytes
URI = "data:image/png;base64," + base64.b64encode(PNG).decode()
CLIP = ImageRules("test/clip", True, frozenset({"127.0.0.1"}), 1000, ("test/clip",))
TEXT_ONLY = ImageRules("test/text", False, frozenset(), 1000, ("test/clip",))


def refused(call, *words: str) -> str:
    with pytest.raises(ShoalError) as caught:
        call()
    assert caught.value.status == 422  # 400 on the OpenAI and Cohere routes
    assert all(w in caught.value.message for w in words), caught.value.message
    return caught.value.message


def test_which_inputs_may_hold_images():
    assert not has_images("a text") and not has_images(["a", "b", "data:text/plain,x"])
    assert not has_images([[101, 102]]) and not has_images([1, 2]) and not has_images(None)
    assert has_images(URI) and has_images(["a", URI])
    assert has_images([{"type": "image_url"}]) and has_images(["a", {"type": "text"}])
    assert has_images({"type": "image_url"})


def test_strings_and_parts_become_items():
    part = {"type": "image_url", "image_url": {"url": URI}}
    items = input_items(["a cat", URI, part, {"type": "image_url", "image_url": URI},
                         {"type": "text", "text": "a dog"}], CLIP)
    assert items == [{"text": "a cat"}, {"image": PNG}, {"image": PNG}, {"image": PNG},
                     {"text": "a dog"}]
    assert input_items(URI, CLIP) == [{"image": PNG}] == input_items(part, CLIP)
    refused(lambda: input_items(["a", 3], CLIP), "input[1]")
    refused(lambda: input_items(["a", ""], CLIP), "input[1]", "empty")
    refused(lambda: input_items([{"type": "audio"}], CLIP), "input[0]", "image_url")


def test_an_image_for_a_text_only_model_is_refused_naming_it():
    message = refused(lambda: input_items(["a", URI], TEXT_ONLY), "input[1]", "test/text",
                      "takes text only", "test/clip")
    assert "test/clip" in message
    refused(lambda: input_items([{"type": "image_url", "image_url": {"url": URI}}], TEXT_ONLY),
            "takes text only")
    # Texts stay texts for it, with no image check beyond the prefix.
    assert input_items(["a", {"type": "text", "text": "b"}], TEXT_ONLY) == \
        [{"text": "a"}, {"text": "b"}]


@pytest.mark.parametrize(("uri", "words"), [
    ("data:image/png;base64,%%%%", ("not valid base64",)),
    ("data:image/png;base64,", ("empty",)),
    ("data:image/bmp;base64,AAAA", ("image/bmp", "image/png")),
    ("data:image/png,rawbytes", ("no base64 image data URI",)),
    ("data:image/png;base64", ("no base64 image data URI",)),
    ("data:text/plain;base64,AAAA", ("no base64 image data URI",)),
    ("data:image/png;base64," + "A" * 2000, ("over the limit of 1000 bytes",)),
])
def test_bad_data_uris_are_refused_saying_what_to_fix(uri: str, words: tuple[str, ...]):
    refused(lambda: decode_data_uri(uri, "input[0]", 1000), "input[0]", *words)


def test_data_uri_types_and_parameters():
    for kind in ("png", "jpeg", "jpg", "webp", "gif", "PNG"):
        assert decode_data_uri(f"data:image/{kind};base64,QUJD", "x", 100) == b"ABC"
    assert decode_data_uri("data:image/png;name=a.png;base64,QUJD", "x", 100) == b"ABC"


def test_messages_are_one_input_a_text_or_an_image():
    image = {"type": "image_url", "image_url": {"url": URI}}
    text = {"type": "text", "text": "a red square"}
    assert messages_item([{"role": "user", "content": [image]}], CLIP) == {"image": PNG}
    assert messages_item([{"role": "system", "content": "be brief"},
                          {"role": "user", "content": [text]}], CLIP) == \
        {"text": "be brief\na red square"}
    refused(lambda: messages_item([{"role": "user", "content": [image, text]}], CLIP),
            "test/clip", "a text or an image, not both")
    refused(lambda: messages_item([{"role": "user", "content": [image, image]}], CLIP),
            "one image per input")
    refused(lambda: messages_item([], CLIP), "'messages'")
    refused(lambda: messages_item([{"role": "user", "content": [3]}], CLIP),
            "messages[0].content[0]")
    refused(lambda: messages_item([{"role": "user", "content": [image]}], TEXT_ONLY),
            "takes text only")


def test_a_url_is_fetched_only_from_a_listed_host():
    refused(lambda: input_items([{"type": "image_url", "image_url": {
        "url": "https://images.example.com/cat.png"}}], CLIP),
        "images.example.com", "SHOAL_IMAGE_URL_HOSTS")
    refused(lambda: input_items([{"type": "image_url", "image_url": {
        "url": "file:///etc/passwd"}}], CLIP), "http(s) URL")
    items = input_items([{"type": "image_url", "image_url": {"url": "http://127.0.0.1/a"}}],
                        CLIP)
    assert isinstance(items[0]["image"], ImageUrl) and url_items(items) == items
    checked = with_stand_ins({"model": "m", "items": [*items, {"text": "t"}]})
    assert checked["items"] == [{"image": b"\0"}, {"text": "t"}]


class _Images(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        port = self.server.server_address[1]
        routes = {
            "/cat.png": (200, {"Content-Type": "image/png"}, PNG),
            "/page": (200, {"Content-Type": "text/html"}, b"<html>"),
            "/big.png": (200, {"Content-Type": "image/png"}, b"x" * 5000),
            "/here": (302, {"Location": "/cat.png"}, b""),
            "/away": (302, {"Location": f"http://localhost:{port}/cat.png"}, b""),
        }
        status, headers, body = routes.get(self.path, (404, {}, b"no"))
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(10)


def _fetched(url: str) -> bytes:
    items = input_items([{"type": "image_url", "image_url": {"url": url}}], CLIP)
    asyncio.run(fetch_images(url_items(items), CLIP))
    return items[0]["image"]


def test_listed_urls_are_fetched_with_their_limits(image_host: str):
    assert _fetched(f"{image_host}/cat.png") == PNG
    assert _fetched(f"{image_host}/here") == PNG  # a redirect on the listed host
    refused(lambda: _fetched(f"{image_host}/away"), "localhost", "SHOAL_IMAGE_URL_HOSTS")
    refused(lambda: _fetched(f"{image_host}/big.png"), "over the limit of 1000 bytes")
    refused(lambda: _fetched(f"{image_host}/page"), "text/html, not an image")
    refused(lambda: _fetched(f"{image_host}/gone.png"), "HTTP 404")
