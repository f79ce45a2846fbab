"""kvtier's encoder cache as vLLM 0.33's encoder-cache connector, driven with vLLM's own classes.

A producer instance saves encoder outputs; a consumer instance (its own
connector objects and cache, the same disk tier) finds them from its
scheduler side and loads them into vLLM's encoder-cache dict on its worker
side. The connector class is found the way vLLM finds it: by module path.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from needs import need_module

need_module("vllm.distributed.ec_transfer.ec_connector.base")

from vllm.config import ECTransferConfig  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvtier.errors import ConfigError  # noqa: E402
from kvtier.integrations.vllm import ec_connector as ec  # noqa: E402

ROWS, DIM = 6, 16


def config(role: str, tier: str, model: str = "llava-tiny", **extra: Any) -> Any:
    """What ECConnectorBase reads of a VllmConfig: its real ECTransferConfig."""
    transfer = ECTransferConfig(
        ec_connector="KvTierECConnector",
        ec_connector_module_path=ec.MODULE_PATH,
        ec_role=role,
        ec_connector_extra_config={"tiers": [tier], "model_id": model, **extra},
    )
    return SimpleNamespace(ec_transfer_config=transfer, model_config=None)


def request(rid: str, mm_hash: str) -> Any:
    feature = MultiModalFeatureSpec(
        data=None, modality="image", identifier=mm_hash,
        mm_position=PlaceholderRange(offset=3, length=ROWS),
    )
    return Request(rid, [1] * 12, SamplingParams(max_tokens=1), None, mm_features=[feature])


def connector(role: str, tier: str, side: Any, **extra: Any) -> Any:
    cfg = config(role, tier, **extra)
    cls = ECConnectorFactory.get_connector_class(cfg.ec_transfer_config)
    return cls(cfg, side)


def consume(tier: str, mm_hash: str, **extra: Any) -> tuple[bool, dict[str, torch.Tensor]]:
    """A consumer's scheduler and worker for one request: found?, and vLLM's cache after."""
    sched = connector("ec_consumer", tier, ECConnectorRole.SCHEDULER, **extra)
    worker = connector("ec_consumer", tier, ECConnectorRole.WORKER, **extra)
    found = sched.has_cache_item(mm_hash)
    sched.update_state_after_alloc(request("c1", mm_hash), 0)
    worker.bind_connector_metadata(sched.build_connector_meta(None))
    cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(cache)
    worker.clear_connector_metadata()
    return found, cache


def produce(tier: str, mm_hash: str, out: torch.Tensor) -> Any:
    worker = connector("ec_producer", tier, ECConnectorRole.WORKER)
    worker.save_caches({mm_hash: out}, mm_hash)
    return worker


def test_vllm_loads_the_connector_by_module_path(tmp_path: Path) -> None:
    cfg = config("ec_both", f"disk:{tmp_path}?size=1MiB")
    assert ECConnectorFactory.get_connector_class(cfg.ec_transfer_config) is ec.KvTierECConnector


def test_a_consumer_instance_loads_what_a_producer_saved(tmp_path: Path) -> None:
    tier = f"disk:{tmp_path}?size=1MiB"
    out = torch.randn(ROWS, DIM)
    produce(tier, "hash-a", out)
    found, cache = consume(tier, "hash-a")
    assert found and torch.equal(cache["hash-a"], out)
    missing, cache = consume(tier, "hash-b")
    assert not missing and cache == {}


@pytest.mark.parametrize(
    "other",
    [{"model_id": "org/another-vlm"}, {"revision": "new-weights"}],
    ids=["another model", "another revision"],
)
def test_another_model_never_gets_the_output(tmp_path: Path, other: dict[str, str]) -> None:
    tier = f"disk:{tmp_path}?size=1MiB"
    out = torch.randn(ROWS, DIM)
    produce(tier, "hash-a", out)
    found, cache = consume(tier, "hash-a", **other)
    assert not found and cache == {}
    # The producer's own model still finds it: the miss is the other model's key.
    found, cache = consume(tier, "hash-a")
    assert found and torch.equal(cache["hash-a"], out)


def test_a_corrupt_blob_is_skipped_and_vllm_encodes(tmp_path: Path) -> None:
    tier = f"disk:{tmp_path}?size=1MiB"
    produce(tier, "hash-a", torch.randn(ROWS, DIM))
    sched = connector("ec_consumer", tier, ECConnectorRole.SCHEDULER)
    sched.update_state_after_alloc(request("c1", "hash-a"), 0)
    meta = sched.build_connector_meta(None)
    assert meta.loads == {"hash-a": ROWS}
    (path,) = tmp_path.rglob("*.kvb")
    blob = bytearray(path.read_bytes())
    blob[-3] ^= 0xFF
    path.write_bytes(bytes(blob))
    worker = connector("ec_consumer", tier, ECConnectorRole.WORKER)
    worker.bind_connector_metadata(meta)
    cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(cache)
    assert cache == {} and worker.cache.stats().tiers["disk"]["corrupt"] == 1


def test_embeddings_of_the_wrong_length_are_not_loaded(tmp_path: Path) -> None:
    tier = f"disk:{tmp_path}?size=1MiB"
    produce(tier, "hash-a", torch.randn(ROWS + 1, DIM))
    found, cache = consume(tier, "hash-a")
    assert found and cache == {}


def test_a_consumer_saves_nothing_and_bad_settings_are_refused(tmp_path: Path) -> None:
    tier = f"disk:{tmp_path}?size=1MiB"
    worker = connector("ec_consumer", tier, ECConnectorRole.WORKER)
    worker.save_caches({"h": torch.ones(2, 2)}, "h")
    assert list(tmp_path.rglob("*.kvb")) == []
    with pytest.raises(ConfigError, match="model_id"):
        connector("ec_both", tier, ECConnectorRole.WORKER, model_id="")
    with pytest.raises(ConfigError, match="memory_bytes"):
        connector("ec_both", tier, ECConnectorRole.WORKER, memory_bytes=0)
