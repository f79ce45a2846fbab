"""kvtier's encoder cache as vLLM 0.33's encoder-cache connector (``ECConnectorBase``).

vLLM instances that load this connector share encoder outputs through
kvtier's tiers: a producer saves each output it computes into an
:class:`~kvtier.mm.cache.EncoderCache` whose lower tiers are disk or Redis;
a consumer's scheduler asks whether an item is there (``has_cache_item``),
and its worker loads it into vLLM's own encoder cache instead of running the
encoder. Every blob is checked (header, checksum, key) before it is used, and
a bad or missing one is a miss, never an error.

Keys: vLLM names an item by its ``mm_hash`` (or the caller's uuid); kvtier
keys it with :meth:`~kvtier.mm.keys.ItemKeyer.id_key` under the model id and
revision, so two models' outputs for the same item never meet, even on one
Redis.

Configure it with ``--ec-transfer-config``::

    {"ec_connector": "KvTierECConnector",
     "ec_connector_module_path": "kvtier.integrations.vllm.ec_connector",
     "ec_role": "ec_both",
     "ec_connector_extra_config": {
         "tiers": ["redis://10.0.0.5:6379/0"],   # or "disk:/var/cache/enc?size=20GiB"
         "memory_bytes": 268435456,             # this process's own cache
         "model_id": "llava-hf/llava-1.5-7b-hf", # default: the served model
         "revision": "main",
         "tenant_salt": ""}}

Loading this module needs vLLM 0.33 (:mod:`.version`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.version import CACHE_POLICY_API, require_vllm
from kvtier.mm.cache import EncoderCache
from kvtier.mm.keys import EncoderSpec

VLLM = require_vllm(CACHE_POLICY_API)

from vllm.distributed.ec_transfer.ec_connector.base import (  # noqa: E402
    ECConnectorBase,
    ECConnectorMetadata,
)

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

#: The module path to give vLLM as ``ec_connector_module_path``.
MODULE_PATH = __name__
#: The default size of a connector's in-process cache.
DEFAULT_MEMORY_BYTES = 256 * 2**20


@dataclass
class KvTierECMetadata(ECConnectorMetadata):  # type: ignore[misc]
    """What the scheduler tells the workers to load this step: ``mm_hash`` -> embeddings."""

    loads: dict[str, int] = field(default_factory=dict)


def _model_id(vllm_config: Any) -> str:
    model_config = getattr(vllm_config, "model_config", None)
    name = getattr(model_config, "model", None)
    return str(name) if name else ""


class KvTierECConnector(ECConnectorBase):  # type: ignore[misc]
    """Encoder outputs shared through kvtier's tiers (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        extra = dict(vllm_config.ec_transfer_config.ec_connector_extra_config or {})
        model_id = str(extra.get("model_id") or _model_id(vllm_config))
        if not model_id:
            raise ConfigError(
                "KvTierECConnector needs the model's id: set model_id in "
                "ec_connector_extra_config"
            )
        tiers = extra.get("tiers", [])
        if isinstance(tiers, str):
            tiers = [tiers]
        if not isinstance(tiers, list) or not all(isinstance(t, str) for t in tiers):
            raise ConfigError(
                "ec_connector_extra_config 'tiers' must be a list of tier URLs, e.g. "
                '["redis://HOST:6379/0"]'
            )
        memory = extra.get("memory_bytes", DEFAULT_MEMORY_BYTES)
        if not isinstance(memory, int) or isinstance(memory, bool) or memory <= 0:
            raise ConfigError(f"memory_bytes must be a positive integer, got {memory!r}")
        #: Every output is an image/video/audio encoder's: one spec per model and revision.
        self.spec = EncoderSpec.make(
            model_id, "vllm-encoder", "embedding", revision=str(extra.get("revision", ""))
        )
        self.cache = EncoderCache(
            memory,
            policy=str(extra.get("policy", "lru")),
            tiers=tiers,
            tenant_salt=str(extra.get("tenant_salt", "")),
        )
        self._pending: dict[str, int] = {}
        self.loaded = 0
        self.saved = 0

    def key(self, mm_hash: str) -> int:
        """The kvtier key of vLLM's item ``mm_hash`` under this model."""
        return self.cache.keyer.id_key(mm_hash, self.spec)

    # -- scheduler side --------------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        return self.cache.contains(self.key(identifier), deep=True)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        mm_hash = request.mm_features[index].identifier
        if self.is_consumer and self.has_cache_item(mm_hash):
            self._pending[mm_hash] = int(request.get_num_encoder_embeds(index))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvTierECMetadata:
        meta = KvTierECMetadata(dict(self._pending))
        self._pending.clear()
        return meta

    # -- worker side -----------------------------------------------------------------------
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        """Load the step's items into vLLM's ``encoder_cache``; a bad or gone blob is skipped.

        An item left out is encoded by vLLM as usual, so a miss here costs
        time, never correctness.
        """
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvTierECMetadata):
            return
        for mm_hash in meta.loads:
            if mm_hash in encoder_cache:
                continue
            tensor = self.cache.get(self.key(mm_hash), self.spec)
            if tensor is None:
                continue
            if tensor.dim() >= 1 and tensor.shape[0] != meta.loads[mm_hash]:
                continue  # not the embeddings this placeholder needs
            encoder_cache[mm_hash] = tensor.to(self._target_device(encoder_cache))
            self.loaded += 1

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        if not self.is_producer:
            return
        tensor = encoder_cache[mm_hash]
        self.cache.put(self.key(mm_hash), tensor.detach().to("cpu"), self.spec)
        self.saved += 1

    def shutdown(self) -> None:
        self.cache.close()

    def _target_device(self, encoder_cache: dict[str, torch.Tensor]) -> torch.device:
        """Where vLLM keeps encoder outputs: beside the ones it has, else its device."""
        for tensor in encoder_cache.values():
            return tensor.device
        device = getattr(getattr(self._vllm_config, "device_config", None), "device", None)
        return torch.device(device) if device is not None else torch.device("cpu")


__all__ = ["MODULE_PATH", "KvTierECConnector", "KvTierECMetadata"]
