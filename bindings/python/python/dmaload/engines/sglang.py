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

The loader is SGLang's ``DefaultModelLoader`` for the ``safetensors``
format, unchanged but at one point, as for vLLM (:mod:`dmaload.engines.vllm`):
its weights iterator's call to ``weight_utils.safetensors_weights_iterator``
(the function that reads the files) gets dmaload's tensors instead. So
SGLang still finds the files, adds a GLM-4 MoE checkpoint's
``mtp.safetensors`` that its index leaves out (``maybe_add_mtp_safetensors``),
keeps a draft model's MTP layer (``_filter_mtp_weights``), applies the
prefixes and times the load; dmaload reads the files, 1/N per rank across
SGLang's world group when there are several. ``--model-loader-extra-config``
takes the keys of :data:`dmaload.engines.EXTRA_CONFIG_KEYS`; SGLang's own
(``enable_multithread_load``, ``num_threads``) choose SGLang's readers,
which this format replaces, and are refused; anything else is an error
listing the keys.

Written against SGLang 0.5.23; ``tests/engines/test_sglang.py`` runs SGLang's
own loader against this one on CPU (``tests/engines/setup-sglang.sh``).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

from ._weights import EngineKeys, LoaderConfig, weights, world_device_group

__all__ = ["LOAD_FORMAT", "SGLANG_KEYS", "loader_class", "register"]

LOAD_FORMAT = "dmaload"

SGLANG_KEYS = EngineKeys(
    "SGLang",
    refused={
        key: "it chooses between SGLang's own safetensors readers, which dmaload replaces "
        "(dmaload's own parallelism: queue_depth, or engine 'pread-pool' with threads)"
        for key in ("enable_multithread_load", "num_threads")
    },
)
"""What SGLang's ``DefaultModelLoader`` does with the extra-config keys it
knows, under ``--load-format dmaload``."""

# SGLang's safetensors_weights_iterator's keyword arguments this loader may
# ignore: its mmap, page-cache prefetch and cache dropping, which dmaload's
# read replaces (it reads each byte once, with direct I/O where it can).
# Another one (an SGLang that passes something new) is an error.
_IGNORED_READER_ARGUMENTS = frozenset({"disable_mmap", "prefetch", "prefetch_num_threads", "drop_cache_after_load"})

logger = logging.getLogger("sglang.dmaload")

# The loader whose DefaultModelLoader._get_weights_iterator is running in
# this thread (and so is about to call the reader), if any.
_reading_for: contextvars.ContextVar[Any] = contextvars.ContextVar("dmaload_sglang_reading_for", default=None)


@functools.cache
def loader_class() -> type:
    """SGLang's ``--load-format dmaload`` loader: ``DefaultModelLoader`` with
    dmaload reading the files. Built on first use, so that the plugin
    imports none of SGLang's model code while SGLang starts."""
    import torch
    from sglang.srt.configs.load_config import LoadFormat
    from sglang.srt.model_loader import loader as sglang_loader
    from sglang.srt.model_loader.loader import DefaultModelLoader

    class DmaloadModelLoader(DefaultModelLoader):  # type: ignore[misc]
        def __init__(self, load_config: Any) -> None:
            extra = load_config.model_loader_extra_config or {}
            if not isinstance(extra, dict):
                raise ValueError(f"dmaload: model_loader_extra_config must be a dict, not {type(extra).__name__}")
            extra = dict(extra)
            self.dmaload_config = LoaderConfig.take(extra, SGLANG_KEYS)
            # DefaultModelLoader finds the files of the "safetensors" format;
            # its single-threaded reader is the call dmaload answers.
            replaced = dataclasses.replace(
                load_config,
                load_format=LoadFormat.SAFETENSORS,
                model_loader_extra_config={"enable_multithread_load": False},
            )
            super().__init__(replaced)
            _install_reader(sglang_loader)
            self._reader_called = False

        def _get_weights_iterator(self, source: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
            """SGLang's own, whose call to the safetensors reader comes to
            :meth:`_dmaload_reader`; an SGLang that no longer calls it there
            is refused (RuntimeError) rather than loaded by its own reader."""
            self._reader_called = False
            token = _reading_for.set(self)
            try:
                tensors = super()._get_weights_iterator(source, **kwargs)
            finally:
                _reading_for.reset(token)
            if not self._reader_called:
                import sglang

                raise RuntimeError(
                    f"dmaload: SGLang {sglang.__version__}'s DefaultModelLoader._get_weights_iterator did not call "
                    "weight_utils.safetensors_weights_iterator for the safetensors files of "
                    f"{source.model_or_path}: --load-format dmaload does not know how this SGLang reads them"
                )
            return tensors  # type: ignore[no-any-return]

        def _dmaload_reader(self, files: list[str], **tuning: Any) -> Iterator[tuple[str, torch.Tensor]]:
            """What SGLang's ``safetensors_weights_iterator(files, ...)``
            would yield, read by dmaload, the tensors on this rank's device."""
            self._reader_called = True
            unknown = sorted(set(tuning) - _IGNORED_READER_ARGUMENTS)
            if unknown:
                raise TypeError(
                    f"dmaload: this SGLang passes safetensors_weights_iterator argument(s) {', '.join(unknown)}, "
                    "which --load-format dmaload does not know"
                )
            return weights(
                files,
                _device(),
                self.dmaload_config,
                process_group=_world_device_group(),
                show_progress=_is_first_rank(),
                log=logger,
            )

    return DmaloadModelLoader


# SGLang's reader, which every other loader of this process keeps calling.
_sglang_reader: Any = None


def _reader(files: list[str], *args: Any, **kwargs: Any) -> Any:
    """``loader.safetensors_weights_iterator`` once a dmaload loader exists:
    dmaload's read for that loader's calls, SGLang's own for the others."""
    loader = _reading_for.get()
    if loader is None:
        return _sglang_reader(files, *args, **kwargs)
    if args:
        raise TypeError("dmaload: this SGLang passes safetensors_weights_iterator positional arguments it does not know")
    return loader._dmaload_reader(files, **kwargs)


def _install_reader(module: Any) -> None:
    global _sglang_reader
    if _sglang_reader is None:
        _sglang_reader = module.safetensors_weights_iterator
        module.safetensors_weights_iterator = _reader


def _device() -> Any:
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _world_device_group() -> Any:
    """SGLang's world device group when there are several ranks, else None."""
    from sglang.srt.runtime_context import get_parallel

    return world_device_group(lambda: get_parallel().world_group)


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
