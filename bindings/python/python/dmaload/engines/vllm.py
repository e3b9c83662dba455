"""vLLM's ``--load-format dmaload``.

Installing dmaload installs a ``vllm.general_plugins`` entry point
(``dmaload = dmaload.engines.vllm:register``), which vLLM runs in each of its
processes (unless ``VLLM_PLUGINS`` leaves it out); :func:`register` adds the
load format. Then::

    vllm serve MODEL --load-format dmaload \\
        --model-loader-extra-config '{"window": "512M"}'
    LLM(MODEL, load_format="dmaload")

:class:`DmaloadModelLoader` is vLLM's ``DefaultModelLoader`` with its weights
iterator replaced: vLLM still finds (or downloads) the safetensors files,
drops duplicate shards, applies the expert-parallel and encoder-only
filters, times the load ("Loading weights took ...") and checks that every
parameter was loaded. The tensors come from
:func:`dmaload.safetensors.iter_tensors` on the worker's device: host memory
on vLLM's CPU build, the GPU otherwise. With several ranks in vLLM's world
group, each rank reads 1/N of the checkpoint and the ranks exchange it on
the world group's device group (NCCL between GPUs, gloo on CPU). Options
come from ``--model-loader-extra-config``: see
:data:`dmaload.engines.EXTRA_CONFIG_KEYS`; vLLM's own keys of that config
(``enable_weights_track``, ...) keep their meaning.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.weight_utils import (
    _BAR_FORMAT,
    enable_tqdm,
    filter_mm_encoder_only_safetensors_files,
    filter_safetensors_files_by_weight_name,
)

from ._weights import EarlyRead, LoaderConfig, start_early, weights, world_device_group

__all__ = ["LOAD_FORMAT", "DmaloadModelLoader", "register"]

LOAD_FORMAT = "dmaload"

# Under "vllm" so that vLLM's logging configuration shows it.
logger = init_logger("vllm.dmaload")


class DmaloadModelLoader(DefaultModelLoader):  # type: ignore[misc]
    """``--load-format dmaload``: safetensors checkpoints read by dmaload."""

    def __init__(self, load_config: Any) -> None:
        extra = dict(load_config.model_loader_extra_config or {})
        self.dmaload_config = LoaderConfig.take(extra)
        # DefaultModelLoader finds the files of the "safetensors" format and
        # refuses extra config keys it does not know: it gets its own.
        super().__init__(dataclasses.replace(load_config, load_format="safetensors", model_loader_extra_config=extra))

    def create_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
        """vLLM's model build, with this rank's read of the checkpoint's
        first files started before it (one rank only): the weights
        iterator then takes over the bytes already in. Started here, inside
        what vLLM times as "Initializing model took", so that its two lines
        together still cover everything dmaload does."""
        self._early = self._start_early(vllm_config, model_config)
        try:
            return super().create_model(vllm_config, model_config, prefix)
        except BaseException:
            self._drop_early()
            raise

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
        try:
            return super().load_model(vllm_config, model_config, prefix)
        finally:
            self._drop_early()  # a load that failed before its weights

    def _start_early(self, vllm_config: Any, model_config: Any) -> EarlyRead | None:
        """The read of the model's files begun now, or None where it must
        wait for ``load_weights``: several ranks (their exchanges run
        collectives, which must not interleave with any vLLM runs while
        building the model), a model-cache service, or an expert-parallel
        MoE (whose filter is known only then)."""
        expert_parallel = model_config.is_moe and vllm_config.parallel_config.enable_expert_parallel
        if _world_device_group() is not None or expert_parallel:
            return None
        _, files, use_safetensors, _ = self._prepare_weights(
            model_config.model, None, model_config.revision, True, None
        )
        if not use_safetensors:
            return None
        return start_early(files, _device(), self.dmaload_config)

    def _drop_early(self) -> None:
        early, self._early = getattr(self, "_early", None), None
        if early is not None:
            early.close()

    def _get_weights_iterator(self, source: Any) -> Iterator[tuple[str, torch.Tensor]]:
        hf_folder, files, use_safetensors, index_file = self._prepare_weights(
            source.model_or_path,
            source.subfolder,
            source.revision,
            source.fall_back_to_pt,
            source.allow_patterns_overrides,
        )
        if not use_safetensors:
            raise ValueError(f"load format {LOAD_FORMAT!r} reads safetensors files; {source.model_or_path} has none")
        if self._encoder_only_lm_prefixes is not None and files:
            files = filter_mm_encoder_only_safetensors_files(
                files,
                hf_folder,
                index_file,
                self._encoder_only_lm_prefixes,
                weights_mapper=self._encoder_only_weights_mapper,
            )
        if source.is_unused_weight is not None:
            files = filter_safetensors_files_by_weight_name(files, source.is_unused_weight)
        group, tensor_filter = _world_device_group(), _expert_filter(self.local_expert_ids)
        # The read begun in create_model, for the files it read; load_model
        # closes it in the end whatever happens here.
        early = getattr(self, "_early", None)
        if early is not None and early.taken:
            early = None  # a secondary source: a load of its own
        elif early is not None and (group is not None or tensor_filter is not None or early.paths != [Path(f) for f in files]):
            self._drop_early()  # not the load that was begun: its reads stop now
            early = None
        if early is not None:
            early.taken = True
        tensors = weights(
            files,
            _device(),
            self.dmaload_config,
            process_group=group,
            tensor_filter=tensor_filter,
            early=early,
            show_progress=enable_tqdm(self.load_config.use_tqdm_on_load),
            log=logger,
            bar_format=_BAR_FORMAT,
        )
        if self.counter_before_loading_weights == 0.0:  # as DefaultModelLoader times it
            self.counter_before_loading_weights: float = time.perf_counter()
        return ((source.prefix + name, tensor) for name, tensor in tensors)


def _device() -> torch.device:
    """Where this worker's weights go: its GPU, or the CPU on the CPU build."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return torch.device("cpu")
    return torch.device(current_platform.current_device())


def _world_device_group() -> Any:
    """vLLM's world device group when there are several ranks, else None."""
    from vllm.distributed import get_world_group

    return world_device_group(get_world_group)


def _expert_filter(local_expert_ids: set[int] | None) -> Any:
    """The expert-parallel filter: the tensors of other ranks' experts are
    never read (None: every tensor)."""
    if local_expert_ids is None:
        return None
    from vllm.model_executor.model_loader.ep_weight_filter import should_skip_weight

    return lambda name: not should_skip_weight(name, local_expert_ids)


_registered = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point: adds ``--load-format
    dmaload`` (once per process; vLLM may call it more than once)."""
    global _registered
    if not _registered:
        register_model_loader(LOAD_FORMAT)(DmaloadModelLoader)
        _registered = True
