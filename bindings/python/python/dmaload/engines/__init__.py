"""dmaload as the weight loader of serving engines.

* vLLM: ``--load-format dmaload`` (``LLM(model, load_format="dmaload")``),
  registered by the ``vllm.general_plugins`` entry point that installing
  dmaload provides (:mod:`dmaload.engines.vllm`).
* SGLang: :mod:`dmaload.engines.sglang`.

Both hand the engine ``(name, tensor)`` pairs from
:func:`dmaload.safetensors.iter_tensors` through :func:`weights`, which
adds the progress bar, the summary line and the engine's options.
"""

from __future__ import annotations

from ._weights import EXTRA_CONFIG_KEYS, EngineKeys, LoaderConfig, weights

__all__ = ["EXTRA_CONFIG_KEYS", "EngineKeys", "LoaderConfig", "weights"]
