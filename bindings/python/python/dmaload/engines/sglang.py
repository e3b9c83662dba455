"""SGLang's ``--load-format dmaload``.

Installing dmaload installs a ``sglang.srt.plugins`` entry point
(``dmaload = dmaload.engines.sglang:register``), which SGLang runs in each of
its processes (unless ``SGLANG_PLUGINS`` leaves it out). :func:`register`
adds ``dmaload`` to ``--load-format``'s choices and hooks
``LoadConfig._verify_load_format`` so that the name ``"dmaload"`` becomes
the class :func:`loader_class` returns: SGLang's ``get_model_loader``
instantiates a ``load_format`` that is a class. Without the plugin, pass
the class itself through the Python API
(``LoadConfig(load_format=loader_class())``).

The loader is SGLang's ``DefaultModelLoader`` with its weights iterator
replaced, as for vLLM (:mod:`dmaload.engines.vllm`): SGLang finds the
safetensors files, dmaload reads them, 1/N per rank across SGLang's world
group when there are several. ``--model-loader-extra-config`` takes the keys
of :data:`dmaload.engines.EXTRA_CONFIG_KEYS` besides SGLang's own.

SGLang on PyPI is a CUDA build (its kernels and flashinfer); this module is
written against SGLang 0.5.23's source and is checked on a GPU machine by
``bench/gpu-kit.sh engines`` where SGLang is installed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from ._weights import LoaderConfig, weights, world_device_group

__all__ = ["LOAD_FORMAT", "loader_class", "register"]

LOAD_FORMAT = "dmaload"

logger = logging.getLogger("sglang.dmaload")


@functools.cache
def loader_class() -> type:
    """SGLang's ``--load-format dmaload`` loader: ``DefaultModelLoader`` with
    dmaload's weights iterator. Built on first use, so that the plugin
    imports none of SGLang's model code while SGLang starts."""
    import torch
    from sglang.srt.model_loader.loader import DefaultModelLoader

    class DmaloadModelLoader(DefaultModelLoader):  # type: ignore[misc]
        def __init__(self, load_config: Any) -> None:
            extra = dict(load_config.model_loader_extra_config or {})
            self.dmaload_config = LoaderConfig.take(extra)
            # DefaultModelLoader finds the files of the "safetensors" format
            # and refuses extra config keys it does not know: it gets its own.
            replaced = dataclasses.replace(load_config, load_format="safetensors", model_loader_extra_config=extra)
            super().__init__(replaced)

        def _get_weights_iterator(
            self, source: Any, *, resolved_source: Any = None, **_prefetch: Any
        ) -> Iterator[tuple[str, torch.Tensor]]:
            if resolved_source is None:
                _folder, files, use_safetensors = self._prepare_weights(
                    source.model_or_path, source.revision, source.fall_back_to_pt, source.allow_patterns_overrides
                )
            else:
                files, use_safetensors = list(resolved_source.weight_files), resolved_source.use_safetensors
            if not use_safetensors:
                raise ValueError(f"load format {LOAD_FORMAT!r} reads safetensors files; {source.model_or_path} has none")
            tensors = weights(
                files,
                _device(),
                self.dmaload_config,
                process_group=_world_device_group(),
                show_progress=_is_first_rank(),
                log=logger,
            )
            if self.load_config.draft_model_idx is not None:
                filtered: Iterator[tuple[str, torch.Tensor]] = self._filter_mtp_weights(
                    tensors, source.prefix, self.load_config.draft_model_idx
                )
                return filtered
            if self.counter_before_loading_weights == 0.0:  # as DefaultModelLoader times it
                self.counter_before_loading_weights: float = time.perf_counter()
            return ((source.prefix + name, tensor) for name, tensor in tensors)

    return DmaloadModelLoader


def _device() -> Any:
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _world_device_group() -> Any:
    """SGLang's world device group when there are several ranks, else None."""
    from sglang.srt.distributed.parallel_state import get_world_group

    return world_device_group(get_world_group)


def _is_first_rank() -> bool:
    import torch

    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _verify_load_format(original: Callable[..., Any], config: Any, *args: Any, **kwargs: Any) -> Any:
    """``LoadConfig._verify_load_format``, where ``"dmaload"`` names the class."""
    if isinstance(config.load_format, str) and config.load_format.lower() == LOAD_FORMAT:
        config.load_format = loader_class()
        return None
    return original(config, *args, **kwargs)


_registered = False


def register() -> None:
    """The ``sglang.srt.plugins`` entry point (once per process)."""
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.choices import LOAD_FORMAT_CHOICES, add_load_format_choices
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if LOAD_FORMAT not in LOAD_FORMAT_CHOICES:
        add_load_format_choices([LOAD_FORMAT])
    HookRegistry.register(
        "sglang.srt.configs.load_config.LoadConfig._verify_load_format", _verify_load_format, HookType.AROUND
    )
    _registered = True
