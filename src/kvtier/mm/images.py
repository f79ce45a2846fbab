"""Image inputs from OpenAI content parts: data URLs, local files under one directory, limits.

A chat message's ``{"type": "image_url", "image_url": {"url": ...}}`` part
becomes a :class:`~kvtier.mm.keys.MediaItem` holding the file's original
bytes (what its cache key hashes) and the decoded PIL image (what the
encoder reads on a miss). Accepted URLs:

* ``data:image/png;base64,...`` (any ``image/*`` type PIL decodes);
* ``file:///path`` only when the server was given an allowed directory
  (``--allowed-local-media-path``), and only for files inside it after
  symlinks are resolved.

Nothing is ever fetched from the network: ``http(s)://`` URLs are refused.
Every refusal is a :class:`~kvtier.errors.BadRequestError` (HTTP 400) naming
the offending part: too many images, a file too large, an image with too many
pixels (checked from its header, before the pixels are decoded), bytes that
do not decode.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from kvtier.errors import BadRequestError, ConfigError
from kvtier.mm.keys import MediaItem

_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[^;,]*)*)"
                       r"(?P<b64>;base64)?,", re.IGNORECASE)


@dataclass(frozen=True)
class ImageLimits:
    """What one request may send."""

    #: Images per request.
    max_images: int = 8
    #: Encoded bytes of one image (the file, not its base64 text).
    max_bytes: int = 16 * 2**20
    #: Pixels of one decoded image (width x height).
    max_pixels: int = 40_000_000
    #: ``file://`` URLs are served from this directory only (``None``: refused).
    allowed_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_images", "max_bytes", "max_pixels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"image limit {name} must be a positive integer, got {value!r}")
        if self.allowed_dir is not None:
            root = Path(self.allowed_dir).expanduser()
            if not root.is_dir():
                raise ConfigError(
                    f"--allowed-local-media-path {self.allowed_dir!r} is not a directory"
                )
            object.__setattr__(self, "allowed_dir", str(root.resolve()))


def check_count(count: int, limits: ImageLimits, param: str = "messages") -> None:
    if count > limits.max_images:
        raise BadRequestError(
            f"the request has {count} images; this server accepts at most "
            f"{limits.max_images} per request (--max-images-per-request)",
            param=param,
        )


def load_image(url: str, limits: ImageLimits, *, param: str) -> MediaItem:
    """The image ``url`` names, read and decoded; :class:`BadRequestError` for anything else."""
    if not isinstance(url, str) or not url:
        raise BadRequestError("an image_url part needs a non-empty url", param=param)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _from_data_url(url, limits, param)
    elif scheme == "file":
        data = _from_file_url(url, limits, param)
    elif scheme in ("http", "https"):
        raise BadRequestError(
            "this server never fetches images from the network: send the image inline as a "
            "data URL (data:image/png;base64,...)",
            param=param,
        )
    else:
        raise BadRequestError(
            f"unsupported image URL scheme {scheme or url[:16]!r}: send a data:image/...;base64 "
            "URL (or file:// under the server's --allowed-local-media-path)",
            param=param,
        )
    return MediaItem("image", data, decoded=decode_image(data, limits, param=param))


def _from_data_url(url: str, limits: ImageLimits, param: str) -> bytes:
    m = _DATA_URL.match(url)
    if m is None or not m.group("b64"):
        raise BadRequestError(
            "an image data URL must look like data:image/png;base64,<base64 bytes>", param=param
        )
    mime = (m.group("mime") or "").lower()
    if not mime.startswith("image/"):
        raise BadRequestError(
            f"the data URL's media type is {mime or 'missing'!r}; send an image/* type",
            param=param,
        )
    text = url[m.end():]
    # Base64 turns 3 bytes into 4 characters: refuse before decoding a huge body.
    if len(text) * 3 // 4 > limits.max_bytes + 2:
        raise BadRequestError(
            f"the image is larger than {limits.max_bytes:,} bytes "
            "(--max-image-bytes): send a smaller image",
            param=param,
        )
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequestError("the image data URL is not valid base64", param=param) from None
    if len(data) > limits.max_bytes:
        raise BadRequestError(
            f"the image is {len(data):,} bytes; at most {limits.max_bytes:,} are accepted "
            "(--max-image-bytes)",
            param=param,
        )
    return data


def _from_file_url(url: str, limits: ImageLimits, param: str) -> bytes:
    if limits.allowed_dir is None:
        raise BadRequestError(
            "file:// image URLs are disabled on this server (start it with "
            "--allowed-local-media-path DIR to serve files under DIR)",
            param=param,
        )
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        raise BadRequestError(
            "a file URL must be file:///absolute/path (no host, query or fragment)", param=param
        )
    root = Path(limits.allowed_dir)
    try:
        path = Path(unquote(parts.path)).resolve(strict=True)
    except (OSError, RuntimeError):
        raise BadRequestError(f"no such image file: {unquote(parts.path)}", param=param) from None
    if not path.is_relative_to(root) or not path.is_file():
        raise BadRequestError(
            f"{unquote(parts.path)} is not a file under the allowed media directory {root}",
            param=param,
        )
    try:
        size = path.stat().st_size
        if size > limits.max_bytes:
            raise BadRequestError(
                f"the image file is {size:,} bytes; at most {limits.max_bytes:,} are accepted "
                "(--max-image-bytes)",
                param=param,
            )
        with open(path, "rb") as fh:
            data = fh.read(limits.max_bytes + 1)
    except OSError as exc:
        raise BadRequestError(f"cannot read the image file: {exc.strerror}", param=param) from None
    if len(data) > limits.max_bytes:  # it grew since stat()
        raise BadRequestError("the image file is too large", param=param)
    return data


def decode_image(data: bytes, limits: ImageLimits, *, param: str = "image") -> object:
    """``data`` decoded to an RGB PIL image; :class:`BadRequestError` if it is not one."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            width, height = img.size
            if width < 1 or height < 1 or width * height > limits.max_pixels:
                raise BadRequestError(
                    f"the image is {width}x{height} pixels; at most {limits.max_pixels:,} "
                    "pixels are accepted",
                    param=param,
                )
            img.load()
            return img.convert("RGB")
    except BadRequestError:
        raise
    except (
        UnidentifiedImageError,
        Image.DecompressionBombError,
        Image.DecompressionBombWarning,
        OSError,
        SyntaxError,
        ValueError,
        EOFError,
    ) as exc:
        raise BadRequestError(
            f"the image cannot be decoded ({type(exc).__name__}): send a PNG, JPEG, WebP or GIF "
            "file",
            param=param,
        ) from None


def image_data_url(data: bytes, mime: str = "image/png") -> str:
    """``data`` as a data URL (what clients send)."""
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


__all__ = ["ImageLimits", "check_count", "decode_image", "image_data_url", "load_image"]
