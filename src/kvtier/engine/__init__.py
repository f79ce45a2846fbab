"""The reference engine: a Hugging Face transformers model generating through kvtier.

* :class:`KvTierCache` - a transformers ``Cache`` whose K/V live in kvtier
  blocks, with prefix reuse (:func:`attach` lets ``generate`` feed it);
* :class:`Engine` - requests, chat template, sampling, streaming, stop
  conditions, per-request metrics;
* :class:`EngineWorker` - runs an engine on its own thread for concurrent callers;
* :func:`load_model` - the default SmolLM2 GGUF, a local directory or a .gguf file.

Needs the ``torch`` and ``serve`` extras (transformers, gguf, accelerate).
"""

from kvtier.engine.engine import Engine, EngineCounters, RequestMetrics, RequestOutput
from kvtier.engine.hf_cache import KvTierCache, attach, layout_for_model
from kvtier.engine.model import DEFAULT_MODEL_ID, LoadedModel, default_model_file, load_model
from kvtier.engine.sampling import Sampler, SamplingParams
from kvtier.engine.worker import EngineWorker, RequestHandle

__all__ = [
    "DEFAULT_MODEL_ID",
    "Engine",
    "EngineCounters",
    "EngineWorker",
    "KvTierCache",
    "LoadedModel",
    "RequestHandle",
    "RequestMetrics",
    "RequestOutput",
    "Sampler",
    "SamplingParams",
    "attach",
    "default_model_file",
    "layout_for_model",
    "load_model",
]
