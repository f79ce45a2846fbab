"""Fixed-size byte pages of an engine's memory as kvtier items: keys, codecs, checksums.

The engines hand kvtier opaque rows of bytes: vLLM a CPU chunk (one row of
its offload buffer), SGLang a host page, llama.cpp a saved state. kvtier
stores each as one item on any medium, with the usual header (key, shape,
dtype, codec, checksums), so whatever comes back is checked before the
engine sees a byte of it.

:class:`FlatPages` fixes one page geometry: ``raw`` keeps the bytes exactly;
``int8`` / ``fp8`` read the page as values of the KV cache's dtype in
groups of ``group`` consecutive values, one scale per group (kvtier's
per-head scaled codecs, applied with each group as a "head" of one token),
which needs no knowledge of the engine's layout and halves an fp16 page.
Lossy pages come back close to, not equal to, what was stored.

:func:`key_id` turns an engine's key (bytes or text, of any length) into
kvtier's 128-bit item key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import xxhash

from kvtier.errors import ConfigError
from kvtier.offload.codec import Codec, make_codec, verify
from kvtier.offload.media import ItemFormat, Stored

#: Value dtypes a lossy codec can read a page as, by the names engines use.
KV_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
}
_GROUPS = (128, 64, 32, 16, 8)


def key_id(key: bytes | str) -> int:
    """kvtier's item key for an engine key: the xxh3-128 of its bytes."""
    data = key.encode() if isinstance(key, str) else bytes(key)
    return int(xxhash.xxh3_128_intdigest(data))


def kv_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype an engine's KV-cache dtype name means, for lossy codecs."""
    if isinstance(name, torch.dtype):
        if name in KV_DTYPES.values():
            return name
        name = str(name).removeprefix("torch.")
    dtype = KV_DTYPES.get(str(name).lower())
    if dtype is None:
        raise ConfigError(
            f"the int8 and fp8 codecs read pages as float16, bfloat16 or float32 values; "
            f"this KV cache is {name!r}: use codec=raw"
        )
    return dtype


@dataclass(frozen=True)
class FlatPages:
    """One page geometry: ``nbytes`` per page, stored with ``codec`` (see the module docs)."""

    nbytes: int
    codec_name: str = "raw"
    #: The dtype of the page's values (lossy codecs only).
    dtype: torch.dtype = torch.uint8
    #: Values per scale (lossy codecs only); the largest of 128, 64, ... that divides.
    group: int = 0

    @classmethod
    def make(
        cls, nbytes: int, codec: str = "raw", dtype: str | torch.dtype | None = None
    ) -> FlatPages:
        """The geometry of ``nbytes`` pages; ``dtype`` names the values for int8 / fp8."""
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ConfigError(f"a page must be a positive number of bytes, got {nbytes!r}")
        make_codec(codec)  # an unknown name fails here
        if codec == "raw":
            return cls(nbytes)
        if dtype is None:
            raise ConfigError(f"the {codec} codec needs the KV cache's dtype")
        values = kv_dtype(dtype)
        if nbytes % values.itemsize:
            raise ConfigError(f"a {nbytes}-byte page is not a whole number of {values} values")
        count = nbytes // values.itemsize
        group = next((g for g in _GROUPS if count % g == 0), 0)
        if not group:
            raise ConfigError(
                f"a page of {count} {values} values has no group size of 8 or more that "
                f"divides it; use codec=raw"
            )
        return cls(nbytes, codec, values, group)

    @property
    def codec(self) -> Codec:
        return make_codec(self.codec_name)

    @property
    def format(self) -> ItemFormat:
        """The :class:`ItemFormat` every page of this geometry is stored with."""
        if self.codec_name == "raw":
            return ItemFormat(self.codec, (self.nbytes,), torch.uint8)
        rows = self.nbytes // self.dtype.itemsize // self.group
        return ItemFormat(self.codec, (rows, 1, 1, 1, self.group), self.dtype)

    @property
    def blob_size(self) -> int:
        """Bytes one stored page takes (header and payload)."""
        return self.format.blob_size

    def encode(self, page: torch.Tensor) -> torch.Tensor:
        """The payload of one page (a flat CPU uint8 tensor of ``nbytes``)."""
        if int(page.numel()) != self.nbytes or page.dtype != torch.uint8:
            raise ConfigError(
                f"a page is {self.nbytes} uint8 values, got {int(page.numel())} {page.dtype}"
            )
        if self.codec_name == "raw":
            return page.reshape(-1)
        fmt = self.format
        return self.codec.encode(page.reshape(-1).view(self.dtype).view(fmt.shape))

    def verified_bytes(self, stored: Stored, key: int) -> memoryview:
        """A stored ``raw`` page's bytes, checked as :meth:`decode_into` checks them, in place.

        No copy and no torch kernel: a caller that hands the bytes to another
        library (llama.cpp) keeps torch's worker threads out of its way.
        """
        if self.codec_name != "raw":
            raise ConfigError(f"{self.codec_name} pages are decoded, not read in place")
        header, payload = stored
        fmt = self.format
        verify(header, payload, key, fmt.shape, fmt.dtype)
        return memoryview(payload.numpy().data)

    def decode_into(self, stored: Stored, key: int, out: torch.Tensor) -> None:
        """Check a stored page against ``key`` and this geometry, and write it into ``out``.

        Raises :class:`~kvtier.CorruptBlockError` (and leaves ``out``
        untouched) when the stored page is damaged, truncated, of another
        key, or of another geometry or codec.
        """
        header, payload = stored
        fmt = self.format
        codec = verify(header, payload, key, fmt.shape, fmt.dtype)
        if self.codec_name == "raw":
            out.reshape(-1).copy_(payload)
            return
        values = codec.decode(payload, fmt.shape, fmt.dtype)
        out.reshape(-1).copy_(values.reshape(-1).view(torch.uint8))
