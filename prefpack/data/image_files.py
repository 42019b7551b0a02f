"""A row's images read and decoded as untrusted input (issue 36; docs/images.md, "What prepare reads").

A row only names its images, so what it names is checked before anything is read or decoded:

- a path must lead (after every symbolic link) inside the input file's folder or ``--image-root``; an absolute path
  elsewhere, ``../`` out of it or a link pointing out is a bad row, and a URL is refused (nothing is downloaded);
- only a regular file is opened (stat first, then opened non-blocking and checked again on the open file): a named
  pipe never blocks prepare and a device (``/dev/zero``) is never read; at most ``--max-image-bytes`` are read;
- bytes are decoded by Pillow's plugins for PNG, JPEG, WebP, GIF, BMP and TIFF only (``IMAGE_FORMATS``): no other
  plugin sees them (Pillow's EPS plugin runs Ghostscript on the file);
- an image over Pillow's ``MAX_IMAGE_PIXELS`` (its decompression-bomb guard) is a bad row naming the limit;
- EXIF orientation is applied, as transformers' ``load_image`` and ``datasets`` do, at prepare (the token count is
  the oriented image's) and at train time (the same pixels): :func:`open_image` is the one decoder of both.

Every refusal is an ``InvalidRow`` naming the field; prepare adds the file and row.
"""

from __future__ import annotations

import io
import os
import re
import stat
import warnings
from dataclasses import dataclass
from typing import Any

from prefpack.data.row_checks import InvalidRow

__all__ = ["DEFAULT_MAX_IMAGE_BYTES", "IMAGE_FORMATS", "ImageSource", "image_bytes", "image_size", "image_tokens",
           "open_image"]

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
FORMAT_NAMES = "PNG, JPEG, WebP, GIF, BMP or TIFF"
DEFAULT_MAX_IMAGE_BYTES = 64 * 2**20
_URL = re.compile(r"^(?:[A-Za-z][A-Za-z0-9+.-]*://|data:)")


@dataclass(frozen=True)
class ImageSource:
    """Where a row's image paths may lead besides the input file's folder, and the most bytes one image may take."""

    root: str | None = None  # prepare --image-root
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # prepare --max-image-bytes


def _short(text: str, n: int = 120) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def image_bytes(value: Any, field: str, k: int, base_dir: str | None, source: ImageSource | None = None) -> bytes:
    """Image `k` of `field` as encoded bytes: a path (relative to the input file's folder, `base_dir`), bytes, a
    `datasets` Image dict ``{"bytes", "path"}`` or a PIL image (saved as PNG)."""
    source = source or ImageSource()
    what = f"field {field!r}: image {k}"
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            value = value["bytes"]
        elif value.get("path"):
            value = value["path"]
        else:
            raise InvalidRow("missing_image", field, f"{what} is a dict with neither 'bytes' nor 'path'")
    if isinstance(value, bytearray | memoryview):
        value = bytes(value)
    if isinstance(value, bytes):
        if len(value) > source.max_bytes:
            raise InvalidRow("image_too_large", field, f"{what} is {len(value):,} bytes, over --max-image-bytes "
                             f"{source.max_bytes:,}")
        return value
    if isinstance(value, str):
        return _read_file(value, field, what, base_dir, source)
    if hasattr(value, "save") and hasattr(value, "size"):  # a PIL image (a `datasets` row decoded in memory)
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return buf.getvalue()
    raise InvalidRow("wrong_type", field, f"{what} must be a file path, bytes or a {{'bytes', 'path'}} object, got "
                     f"{type(value).__name__}")


def refuse_url(value: Any, field: str, what: str) -> None:
    """A URL (a scheme, or ``data:``) where an image path goes is a bad row: prepare reads local files and bytes only
    and fetches nothing, whichever reader (JSONL, Parquet, a ``datasets`` folder) brought the row."""
    if isinstance(value, str) and _URL.match(value):
        raise InvalidRow("image_url", field, f"{what} is a URL ({_short(value)}): prepare reads local files only and "
                         "downloads nothing; fetch the images first and give their paths (or bytes)")


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def _read_file(value: str, field: str, what: str, base_dir: str | None, source: ImageSource) -> bytes:
    """The file a row names, if it is a regular file inside the allowed folders and not over the size limit."""
    refuse_url(value, field, what)
    if "\0" in value:
        raise InvalidRow("missing_image", field, f"{what}: the path {_short(value)} holds a NUL character")
    base = os.path.abspath(base_dir or os.getcwd())
    path = os.path.join(base, value)  # an absolute value stays itself
    real = os.path.realpath(path)
    roots = [os.path.realpath(base)] + ([os.path.realpath(source.root)] if source.root else [])
    if not any(_inside(real, r) for r in roots):
        link = "" if real == os.path.normpath(os.path.abspath(path)) else f" (a symbolic link to {real!r})"
        allowed = f"the input file's folder {roots[0]!r}" + (f" or --image-root {roots[1]!r}" if source.root else "")
        raise InvalidRow("image_outside", field, f"{what}: the path {_short(value)} leads outside {allowed}{link}; "
                         "prepare reads images only from there (give --image-root DIR to allow another folder)")
    try:
        st = os.stat(real)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidRow("image_not_a_file", field, f"{what}: {_short(path, 300)} is {_kind(st.st_mode)}, not a regular "
                             "file; prepare reads image files only")
        _check_size(st.st_size, field, what, path, source)
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())  # the file opened is the one checked (not swapped since the stat)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidRow("image_not_a_file", field, f"{what}: {_short(path, 300)} is {_kind(st.st_mode)}, not a "
                                 "regular file; prepare reads image files only")
            data = fh.read(source.max_bytes + 1)
    except OSError as exc:
        raise InvalidRow("missing_image", field, f"{what}: cannot read the file {_short(path, 300)} ({exc.strerror or exc}); "
                         "relative paths are read from the input file's folder") from None
    _check_size(len(data), field, what, path, source)
    return data


def _check_size(size: int, field: str, what: str, path: str, source: ImageSource) -> None:
    if size > source.max_bytes:
        raise InvalidRow("image_too_large", field, f"{what}: the file {_short(path, 300)} is {size:,} bytes, over "
                         f"--max-image-bytes {source.max_bytes:,}")


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def open_image(data: bytes):
    """Encoded bytes as a loaded Pillow image, decoded by the allowed formats' plugins only, EXIF orientation
    applied (what transformers' ``load_image`` gives). Raises what Pillow raises."""
    from PIL import Image, ImageOps

    image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    image.load()
    ImageOps.exif_transpose(image, in_place=True)
    return image


def image_size(data: bytes, field: str, k: int) -> tuple[int, int]:
    """Decode the image fully (a truncated file fails here, not in training) and return its (width, height) once
    oriented (the size the processor sees)."""
    from PIL import Image, ImageOps

    what = f"field {field!r}: image {k} ({len(data):,} bytes)"
    limit = Image.MAX_IMAGE_PIXELS
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # checked below, naming the row
            img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        with img:
            w, h = img.size
            if limit and w * h > limit:
                raise InvalidRow("image_too_large", field, f"{what} is {w}x{h} = {w * h:,} pixels, over Pillow's "
                                 f"limit of {limit:,} (PIL.Image.MAX_IMAGE_PIXELS, its decompression-bomb guard)")
            img.load()
            ImageOps.exif_transpose(img, in_place=True)
            return int(img.size[0]), int(img.size[1])
    except InvalidRow:
        raise
    except Image.DecompressionBombError as exc:
        raise InvalidRow("image_too_large", field, f"{what}: {exc} (PIL.Image.MAX_IMAGE_PIXELS)") from None
    except Image.UnidentifiedImageError:
        raise InvalidRow("undecodable_image", field, f"{what} cannot be decoded: it is not a {FORMAT_NAMES} image "
                         "(the only formats prepare decodes)") from None
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError... on a damaged file
        raise InvalidRow("undecodable_image", field, f"{what} cannot be decoded ({type(exc).__name__}: {exc})"
                         ) from None


def image_tokens(vision: Any, width: int, height: int, field: str, k: int) -> int:
    """The image tokens the processor gives an image of this size (``Vision.placeholder_tokens``); a size it refuses
    (Qwen2-VL: an aspect ratio of 200 or more) or gives no token is a bad row, not a traceback."""
    try:
        n = vision.placeholder_tokens(width, height)
    except ValueError as exc:
        raise InvalidRow("image_refused", field, f"field {field!r}: image {k} ({width}x{height} pixels) is refused by "
                         f"the image processor ({exc})") from None
    if n <= 0:  # LLaVA without a crop: an image smaller than a patch
        raise InvalidRow("image_too_small", field, f"field {field!r}: image {k} ({width}x{height} pixels) gets "
                         f"{n} image tokens from the processor, which sees no patch of it; give a larger image")
    return n
