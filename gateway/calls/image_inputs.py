"""Images in the embedding routes' bodies, as task items: OpenAI's `input` and vLLM's
`messages` on /v1/embeddings (`gateway.routes.embeddings`), Cohere's `images` and `inputs`
on /v2/embed and /v1/embed (`gateway.routes.cohere_embed`).

The rule for a string: one that starts with `data:image/` is an image, and must be a base64
data URI, `data:image/<type>;base64,<data>`, the type one of png, jpeg (jpg), webp, gif
(the formats the image models' workers decode: `runtimes.families.clip`); every other
string is text. A text that really starts with those 11 characters is no text on these
routes: send it to /v1/encode/{model} as `{"text": ...}`. An image object is a chat content
part, `{"type": "image_url", "image_url": {"url": ...}}` (or the URL string as
`image_url`); `{"type": "text", "text": ...}` is a text. A list of plain texts pays one
prefix test per string for all this (`has_images`), nothing more.

Images are decoded here and travel to the worker as raw bytes (msgpack bin; those over
SHOAL_CLAIM_CHECK_BYTES through the blob store, `gateway.calls.blob_offload`), never as
base64. Only a model whose catalog entry takes images (CLIP's) gets one: an image sent to
a text-only model is a 400 naming the model, never a vector of the URI's characters. The
worker decodes the bytes: what is no PNG, JPEG, WebP or GIF comes back as a 400 for that
item, and the worker carries on.

An http(s) URL is fetched only from a host that SHOAL_IMAGE_URL_HOSTS lists (none by
default: fetching whatever a caller names would let any caller reach what the gateway can,
SSRF), with `FETCH_TIMEOUT_S`, at most the image routes' body limit
(SHOAL_MAX_CLAIM_BODY_BYTES) of bytes, and redirects followed only to listed hosts.

vLLM's `messages` (`{"model", "messages": [{"role", "content"}]}`) is one input, one
embedding. shoal's image models (CLIP) embed a text or an image, not both together: the
text parts (and string contents) are joined by newlines into one text, a single image part
is that image, and a mix of text and image, or several images, is a 400.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from gateway.edge.api_errors import invalid
from tasks.adapters import IMAGE
from tasks.catalog import ModelEntry
from tasks.render import shown

DATA_IMAGE = "data:image/"
# The formats the workers decode (runtimes.families.clip.IMAGE_FORMATS), by media subtype.
IMAGE_TYPES = frozenset({"png", "jpeg", "jpg", "webp", "gif"})
FETCH_TIMEOUT_S = 10.0
MAX_REDIRECTS = 3
_SHOWN_URL = 80  # characters of a URL an error message repeats
_PART = "{'type': 'image_url', 'image_url': {'url': ...}} or {'type': 'text', 'text': ...}"


@dataclass(frozen=True, slots=True)
class ImageRules:
    """What a request's images may be: for which model, and from which hosts."""

    model: str
    takes_images: bool
    hosts: frozenset[str]  # SHOAL_IMAGE_URL_HOSTS, lowercased
    max_bytes: int
    image_models: tuple[str, ...] = ()  # served models that take images, for messages


@dataclass(frozen=True, slots=True)
class ImageUrl:
    """An image still to fetch (`fetch_images`), where the request named it."""

    url: str
    where: str


def image_rules(request: Request, entry: ModelEntry) -> ImageRules:
    settings = request.app.state.settings
    served = request.app.state.served
    return ImageRules(
        model=entry.id, takes_images=IMAGE in entry.contract.inputs,
        hosts=frozenset(h.lower() for h in settings.image_url_hosts),
        max_bytes=max(settings.max_claim_body_bytes, settings.max_body_bytes),
        image_models=tuple(sorted(m for m, e in served.items() if IMAGE in e.contract.inputs)))


def has_images(value: Any) -> bool:
    """Whether an OpenAI `input` may hold images (then `input_items` parses it): a cheap
    test that a list of plain strings passes with one prefix check each."""
    if type(value) is str:
        return value.startswith(DATA_IMAGE)
    if type(value) is not list:
        return type(value) is dict  # one content part
    for v in value:
        if type(v) is not str:
            return type(v) is dict  # else token ids: no images (a mix is refused as before)
        if v.startswith(DATA_IMAGE):
            return True
    return False


def input_items(value: Any, rules: ImageRules, field: str = "input") -> list[dict[str, Any]]:
    """The items of an OpenAI `input` that holds images: strings (texts, or data URIs) and
    content parts, in one list or alone."""
    values = value if type(value) is list else [value]
    if not values:
        raise invalid(f"'{field}' is an empty list; send at least one input")
    items = []
    for i, v in enumerate(values):
        where = f"{field}[{i}]"
        if type(v) is str:
            items.append(string_item(v, where, rules))
        elif type(v) is dict:
            items.append(part_item(v, where, rules))
        else:
            raise invalid(f"{where} is {shown(v)}: with images, each input is a string (a "
                          f"text or a data:image/ URI) or {_PART}")
    return items


def string_item(value: str, where: str, rules: ImageRules) -> dict[str, Any]:
    if value.startswith(DATA_IMAGE):
        return {"image": image_source(value, where, rules)}
    if not value:
        raise invalid(f"{where} is an empty string; send at least one character")
    return {"text": value}


def part_item(part: dict[str, Any], where: str, rules: ImageRules) -> dict[str, Any]:
    """A chat content part as an item: a text, or an image (a data URI or a listed URL)."""
    kind = part.get("type")
    if kind == "text":
        text = part.get("text")
        if type(text) is not str or not text:
            raise invalid(f"{where}.text must be a non-empty string")
        return {"text": text}
    if kind == "image_url":
        url = part.get("image_url")
        if type(url) is dict:
            url = url.get("url")
        if type(url) is not str or not url:
            raise invalid(f"{where}.image_url.url must be a data:image/ URI or an http(s) URL")
        return {"image": image_source(url, f"{where}.image_url.url", rules)}
    raise invalid(f"{where} must be {_PART}, got type {shown(kind)}")


def one_input(parts: list[dict[str, Any]], where: str, rules: ImageRules) -> dict[str, Any]:
    """Several parts (a vLLM conversation, a Cohere input) as one item: their texts joined
    by newlines, or their one image; CLIP embeds a text or an image, not both together."""
    texts = [p["text"] for p in parts if "text" in p]
    images = [p["image"] for p in parts if "image" in p]
    if (images and texts) or len(images) > 1:
        raise invalid(f"{where} holds {len(texts)} text and {len(images)} image parts: "
                      f"{rules.model} embeds a text or an image, not both together (and one "
                      "image per input); send them as separate inputs")
    return {"image": images[0]} if images else {"text": "\n".join(texts)}


def messages_item(messages: Any, rules: ImageRules) -> dict[str, Any]:
    """vLLM's `messages` on /v1/embeddings: one input (see the module doc)."""
    if type(messages) is not list or not messages:
        raise invalid("'messages' must be a non-empty list of {'role', 'content'}")
    parts: list[dict[str, Any]] = []
    for j, message in enumerate(messages):
        where = f"messages[{j}]"
        content = message.get("content") if type(message) is dict else None
        if type(content) is str:
            if content:
                parts.append({"text": content})
        elif type(content) is list and content:
            for k, part in enumerate(content):
                if type(part) is not dict:
                    raise invalid(f"{where}.content[{k}] is {shown(part)}: a content part is "
                                  f"{_PART}")
                parts.append(part_item(part, f"{where}.content[{k}]", rules))
        else:
            raise invalid(f"{where} must be {{'role', 'content'}}, the content a string or a "
                          f"list of {_PART}")
    if not parts:
        raise invalid("'messages' holds no text and no image to embed")
    return one_input(parts, "'messages'", rules)


def image_source(url: str, where: str, rules: ImageRules) -> bytes | ImageUrl:
    """The bytes of a data URI, or a listed http(s) URL to fetch; 400 for anything else, and
    for any image at all when the model takes text only."""
    if not rules.takes_images:
        others = f" (served models that do: {list(rules.image_models)})" if rules.image_models \
            else ""
        raise invalid(f"{where} is an image, but {rules.model} takes text only: send it "
                      f"text, and images to a model that takes them{others}")
    if url.startswith("data:"):
        return decode_data_uri(url, where, rules.max_bytes)
    scheme = url.split(":", 1)[0].lower()
    if scheme not in ("http", "https"):
        raise invalid(f"{where} must be a data:image/<type>;base64, URI or an http(s) URL, got "
                      f"{shown(url[:_SHOWN_URL])}")
    check_host(url, where, rules.hosts)
    return ImageUrl(url, where)


def decode_data_uri(uri: str, where: str, max_bytes: int) -> bytes:
    """The bytes of `data:image/<type>;base64,<data>`; 400 naming what is wrong."""
    header, comma, data = uri.partition(",")
    params = header.removeprefix("data:").split(";")
    media = params[0].lower()
    if not comma or params[-1].lower() != "base64" or not media.startswith("image/"):
        raise invalid(f"{where} is no base64 image data URI: send "
                      "data:image/<type>;base64,<the image's bytes in base64>")
    subtype = media.removeprefix("image/")
    if subtype not in IMAGE_TYPES:
        raise invalid(f"{where} is {media}, a type shoal's image models do not decode: send "
                      "image/png, image/jpeg, image/webp or image/gif")
    if len(data) // 4 * 3 > max_bytes:
        raise invalid(f"{where} is over the limit of {max_bytes} bytes of image; send a "
                      "smaller image")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"{where} is not valid base64 after 'base64,'; encode the image's bytes "
                      "with standard base64 (A-Z a-z 0-9 + /, padded with =)") from None
    if not raw:
        raise invalid(f"{where} is an empty image")
    return raw


def check_host(url: str, where: str, hosts: frozenset[str]) -> None:
    import httpx

    try:
        host = httpx.URL(url).host.lower()
    except (httpx.InvalidURL, ValueError):
        raise invalid(f"{where} is not a valid URL: {shown(url[:_SHOWN_URL])}") from None
    if not host:
        raise invalid(f"{where} has no host: {shown(url[:_SHOWN_URL])}")
    if host not in hosts:
        raise invalid(f"{where} is a URL on {host}, which this gateway does not fetch from: "
                      "the operator must list the host in SHOAL_IMAGE_URL_HOSTS (or send "
                      "the image inline as a data:image/<type>;base64, URI)")


def url_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The items whose image is a URL still to fetch."""
    return [item for item in items if isinstance(item.get("image"), ImageUrl)]


def with_stand_ins(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` for the schema's check before the URLs are fetched: each URL's image a
    one-byte stand-in (the schema checks that an image is bytes, not which; the fetched
    bytes are the worker's to decode)."""
    return {**kwargs, "items": [{"image": b"\0"} if isinstance(item.get("image"), ImageUrl)
                                else item for item in kwargs["items"]]}


async def fetch_images(items: list[dict[str, Any]], rules: ImageRules) -> None:
    """Replace, in place, each item's `ImageUrl` (`url_items`) by the bytes it names, all
    fetched at once."""
    import httpx

    async with httpx.AsyncClient(follow_redirects=False, timeout=FETCH_TIMEOUT_S,
                                 trust_env=False) as client:
        fetched = await asyncio.gather(*(_fetch(client, item["image"], rules)
                                         for item in items))
    for item, data in zip(items, fetched, strict=True):
        item["image"] = data


async def _fetch(client: Any, ref: ImageUrl, rules: ImageRules) -> bytes:
    import httpx

    url = ref.url
    try:
        for _ in range(MAX_REDIRECTS + 1):
            async with client.stream("GET", url) as response:
                if response.is_redirect:
                    url = str(response.url.join(response.headers.get("location", "")))
                    check_host(url, f"{ref.where} (redirected)", rules.hosts)
                    continue
                return await _body(response, ref, url, rules.max_bytes)
    except httpx.HTTPError as exc:
        raise invalid(f"{ref.where}: fetching {shown(url[:_SHOWN_URL])} failed "
                      f"({type(exc).__name__}: {exc}); check the URL, or send the image "
                      "inline as a data URI") from None
    raise invalid(f"{ref.where}: {shown(ref.url[:_SHOWN_URL])} redirects more than "
                  f"{MAX_REDIRECTS} times")


async def _body(response: Any, ref: ImageUrl, url: str, max_bytes: int) -> bytes:
    shown_url = shown(url[:_SHOWN_URL])
    if response.status_code != 200:
        raise invalid(f"{ref.where}: fetching {shown_url} answered HTTP "
                      f"{response.status_code}")
    kind = response.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind and not kind.startswith("image/"):
        raise invalid(f"{ref.where}: {shown_url} is {kind}, not an image")
    declared = response.headers.get("content-length", "")
    too_large = invalid(f"{ref.where}: {shown_url} is over the limit of {max_bytes} bytes "
                        "of image")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    if not size:
        raise invalid(f"{ref.where}: {shown_url} is empty")
    return b"".join(chunks)


def openai_image_items(request: Request, entry: ModelEntry, body: dict[str, Any],
                       urls: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The items of a /v1/embeddings body whose `input` holds images (`has_images`) or that
    sends vLLM's `messages` instead. The items with a URL to fetch are added to `urls`; with
    None (an OpenAI batch line, which nothing fetches for) a URL is refused."""
    rules = image_rules(request, entry)
    if body.get("messages") is not None:
        if body.get("input") is not None:
            raise invalid("send 'input' or 'messages', not both")
        items = [messages_item(body["messages"], rules)]
    else:
        items = input_items(body.get("input"), rules)
    pending = url_items(items)
    if pending:
        if urls is None:
            raise invalid(f"{pending[0]['image'].where} is a URL: image URLs are fetched on "
                          "POST /v1/embeddings itself only; send the image inline as a "
                          "data:image/<type>;base64, URI")
        urls.extend(pending)
    return items
