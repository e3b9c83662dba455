"""vLLM's ``--load-format dmaload``.

Installing dmaload installs a ``vllm.general_plugins`` entry point
(``dmaload = dmaload.engines.vllm:register``), which vLLM runs in each of its
processes (unless ``VLLM_PLUGINS`` leaves it out); :func:`register` adds the
load format. Then::

    vllm serve MODEL --load-format dmaload \\
        --model-loader-extra-config '{"window": "512M"}'
    LLM(MODEL, load_format="dmaload")

:class:`DmaloadModelLoader` is vLLM's ``DefaultModelLoader`` for the
``safetensors`` format, unchanged but at one point: where its weights
iterator calls ``weight_utils.safetensors_weights_iterator(files, ...)``
(the one function that reads the files), this loader's calls get
:func:`dmaload.safetensors.iter_tensors`' tensors instead. Everything vLLM
does around that call still runs, whatever its version does there: it finds
(or downloads) the files, drops duplicate shards, applies the
expert-parallel and encoder-only filters and whatever steps it adds between
the reader and the model (such as decoding a checkpoint's CSF scale
streams), applies the prefixes, times the load ("Loading weights took ...")
and checks that every parameter was loaded. The tensors come on the
worker's device: host memory on vLLM's CPU build, the GPU otherwise. With
several ranks in vLLM's world group, each rank reads 1/N of the checkpoint
and the ranks exchange it on the world group's device group (NCCL between
GPUs, gloo on CPU).

Weights in object storage: ``--model-loader-extra-config
'{"weights": "s3://B/DIR/"}'`` with ``MODEL`` a local directory of the
model's config files (vLLM 0.32 refuses an ``s3://`` MODEL, or
``model_weights``, for any load format but its own streamers'). The
loader reads the weights from that URL (else from
``model_config.model_weights`` where a vLLM leaves an ``s3://`` URL
there): the core resolves the shards, and
:func:`dmaload.safetensors.iter_tensors` streams them shard by shard, on
one rank without an expert filter (docs/object-storage.md).

``--model-loader-extra-config`` is checked when the loader is made: its
keys are dmaload's (:data:`dmaload.engines.EXTRA_CONFIG_KEYS`) and vLLM's
``enable_weights_track``; vLLM's ``enable_multithread_load`` and
``num_threads`` choose vLLM's own multi-threaded reader, which this format
replaces, so they are refused; anything else is an error listing the keys.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.model_loader import default_loader, register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.weight_utils import enable_tqdm

from .. import _dmaload
from .._cache import socket_for
from ..safetensors import _is_object_url, iter_tensors
from ._weights import EarlyRead, EngineKeys, LoaderConfig, start_early, weights, world_device_group

__all__ = ["LOAD_FORMAT", "VLLM_KEYS", "DmaloadModelLoader", "register"]

LOAD_FORMAT = "dmaload"

INDEX_NAME = "model.safetensors.index.json"

VLLM_KEYS = EngineKeys(
    "vLLM",
    kept={"enable_weights_track": bool},
    refused={
        key: "it chooses vLLM's own multi-threaded safetensors reader, which dmaload replaces "
        "(dmaload's own parallelism: queue_depth, or engine 'pread-pool' with threads)"
        for key in ("enable_multithread_load", "num_threads")
    },
    own={"weights": str},
)
"""What vLLM's ``DefaultModelLoader`` does with the extra-config keys it
knows, under ``--load-format dmaload``."""

# The keyword arguments of vLLM's safetensors_weights_iterator that this
# loader knows it may ignore: they tune the page-cache prefetch of vLLM's
# reader, which dmaload's read replaces. Another one (a vLLM that passes
# something new) is an error, so its meaning is never dropped silently.
_IGNORED_READER_ARGUMENTS = frozenset({"safetensors_prefetch_num_threads", "safetensors_prefetch_block_size"})

# Under "vllm" so that vLLM's logging configuration shows it.
logger = init_logger("vllm.dmaload")

# The DmaloadModelLoader whose DefaultModelLoader._get_weights_iterator is
# running in this thread (and so is about to call the reader), if any.
_reading_for: contextvars.ContextVar[DmaloadModelLoader | None] = contextvars.ContextVar(
    "dmaload_vllm_reading_for", default=None
)


class DmaloadModelLoader(DefaultModelLoader):  # type: ignore[misc]
    """``--load-format dmaload``: safetensors checkpoints read by dmaload."""

    def __init__(self, load_config: Any) -> None:
        extra = load_config.model_loader_extra_config
        if not isinstance(extra, dict):
            raise ValueError(f"dmaload: model_loader_extra_config must be a dict, not {type(extra).__name__}")
        extra = dict(extra)
        self.dmaload_config = LoaderConfig.take(extra, VLLM_KEYS)
        self._weights_url: str | None = extra.pop("weights", None)
        if self._weights_url is not None and not _is_object_url(self._weights_url):
            raise ValueError(f"dmaload: weights must be an s3:// URL (the model's weights), not {self._weights_url!r}")
        if load_config.safetensors_load_strategy == "torchao":
            raise ValueError(_TORCHAO)
        # DefaultModelLoader finds the files of the "safetensors" format,
        # and reads vLLM's own keys (those dmaload's check left).
        super().__init__(dataclasses.replace(load_config, load_format="safetensors", model_loader_extra_config=extra))
        _install_reader()
        self._early: EarlyRead | None = None
        self._reader_called = False

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
        MoE (whose filter is known only then). The files are those vLLM's
        ``_prepare_weights`` finds; the weights iterator takes the read
        over only if vLLM then hands the reader the same files (its filters
        may drop some), else it is stopped and the load reads as usual. So
        a vLLM whose ``_prepare_weights`` changed only loses the head start."""
        expert_parallel = model_config.is_moe and vllm_config.parallel_config.enable_expert_parallel
        if _world_device_group() is not None or expert_parallel or self._object_weights(model_config):
            return None
        try:
            _, files, use_safetensors, _ = self._prepare_weights(
                model_config.model, None, model_config.revision, True, None
            )
        except (AttributeError, TypeError, ValueError) as exc:
            logger.info("dmaload: the read starts with load_weights (vLLM's _prepare_weights: %s)", exc)
            return None
        if not use_safetensors:
            return None
        return start_early(files, _device(), self.dmaload_config)

    def _drop_early(self) -> None:
        early, self._early = self._early, None
        if early is not None:
            early.close()

    def get_all_weights(self, model_config: Any, model: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """vLLM's, with the primary weights at the ``s3://`` URL of
        :meth:`_object_weights` where there is one (``model`` is then a local
        directory of the config files)."""
        url = self._object_weights(model_config)
        if url is not None:
            model_config = _WeightsAt(model_config, url)
        return super().get_all_weights(model_config, model)  # type: ignore[no-any-return]

    def _object_weights(self, model_config: Any) -> str | None:
        """The ``s3://`` URL of the model's weights: the extra config's
        ``weights``, else the one vLLM keeps in ``model_config.model_weights``
        for a model in object storage; None for a model on disk."""
        url = self._weights_url or getattr(model_config, "model_weights", "")
        return url if _is_object_url(url) else None

    def _prepare_weights(self, model_name_or_path: str, *args: Any, **kwargs: Any) -> tuple[str, list[str], bool, str]:
        """vLLM's, but for an ``s3://`` model: the shards the core resolves
        (the prefix's ``model.safetensors.index.json``, else its
        ``model.safetensors``; an index or one object as named), not found
        on a disk or downloaded from the Hugging Face hub. (vLLM's other
        arguments pass through as its version gives them: subfolder,
        revision, fall_back_to_pt, allow_patterns_overrides in 0.32.)"""
        if not _is_object_url(model_name_or_path):
            return super()._prepare_weights(model_name_or_path, *args, **kwargs)  # type: ignore[no-any-return]
        subfolder = kwargs.get("subfolder", args[0] if args else None)
        allow = kwargs.get("allow_patterns_overrides", args[3] if len(args) > 3 else None)
        if subfolder or allow:
            raise ValueError(
                f"dmaload: {model_name_or_path}: a subfolder or allow patterns of an s3:// model are not read yet"
            )
        url = model_name_or_path
        if not url.endswith(("/", ".json", ".safetensors")):
            url += "/"  # a prefix, as vLLM and runai_streamer take it
        shards, _ = _dmaload.resolve_model(url)
        return url, shards, True, INDEX_NAME

    def _get_weights_iterator(self, source: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """vLLM's own, whose call to the safetensors reader comes to
        :meth:`_dmaload_reader`; a vLLM that no longer calls it there is
        refused (RuntimeError) rather than loaded by its own reader."""
        self._reader_called = False
        token = _reading_for.set(self)
        try:
            tensors = super()._get_weights_iterator(source)
        finally:
            _reading_for.reset(token)
        if not self._reader_called:
            import vllm

            raise RuntimeError(
                f"dmaload: vLLM {vllm.__version__}'s DefaultModelLoader._get_weights_iterator did not call "
                "weight_utils.safetensors_weights_iterator for the safetensors files of "
                f"{source.model_or_path}: --load-format dmaload does not know how this vLLM reads them"
            )
        return tensors  # type: ignore[no-any-return]

    def _dmaload_reader(
        self,
        files: list[str],
        use_tqdm_on_load: bool,
        safetensors_load_strategy: str | None = None,
        local_expert_ids: set[int] | None = None,
        **tuning: Any,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """What vLLM's ``safetensors_weights_iterator(files, ...)`` would
        yield, read by dmaload: the same (name, tensor) pairs, the tensors
        on this worker's device."""
        self._reader_called = True
        unknown = sorted(set(tuning) - _IGNORED_READER_ARGUMENTS)
        if unknown:
            raise TypeError(
                f"dmaload: this vLLM passes safetensors_weights_iterator argument(s) {', '.join(unknown)}, "
                "which --load-format dmaload does not know"
            )
        if safetensors_load_strategy == "torchao":
            raise ValueError(_TORCHAO)
        group, tensor_filter = _world_device_group(), _expert_filter(local_expert_ids)
        if files and _is_object_url(files[0]):
            if group is not None or tensor_filter is not None:
                raise ValueError(
                    f"dmaload: {files[0]}: an s3:// model loads on one rank without an expert filter so far "
                    "(docs/object-storage.md)"
                )
            if socket_for(self.dmaload_config.cache) is None:
                logger.info("dmaload: streaming %d shard(s) from object storage, shard by shard", len(files))
                return iter_tensors(list(files), _device())
            # With a model-cache service: each shard whole from it (the
            # service reads it with this process's grant, once per version).
        # The read begun in create_model, for the files it read; load_model
        # closes it in the end whatever happens here.
        early = self._early
        if early is not None and early.taken:
            early = None  # a secondary source: a load of its own
        elif early is not None and (group is not None or tensor_filter is not None or early.paths != [Path(f) for f in files]):
            self._drop_early()  # not the load that was begun: its reads stop now
            early = None
        if early is not None:
            early.taken = True
        return weights(
            files,
            _device(),
            self.dmaload_config,
            process_group=group,
            tensor_filter=tensor_filter,
            early=early,
            show_progress=enable_tqdm(use_tqdm_on_load),
            log=logger,
        )


_TORCHAO = (
    "dmaload: safetensors_load_strategy 'torchao' (a checkpoint of torchao tensor subclasses) is not read by "
    "load format 'dmaload': use load format 'safetensors'"
)

# vLLM's reader, which every other loader of this process keeps calling.
_vllm_reader: Any = None


def _reader(files: list[str], *args: Any, **kwargs: Any) -> Any:
    """``default_loader.safetensors_weights_iterator`` once a
    DmaloadModelLoader exists: dmaload's read for that loader's calls, vLLM's
    own for every other loader."""
    loader = _reading_for.get()
    if loader is None:
        return _vllm_reader(files, *args, **kwargs)
    return loader._dmaload_reader(files, *args, **kwargs)


def _install_reader() -> None:
    global _vllm_reader
    if _vllm_reader is None:
        _vllm_reader = default_loader.safetensors_weights_iterator
        default_loader.safetensors_weights_iterator = _reader


def _device() -> torch.device:
    """Where this worker's weights go: its GPU, or the CPU on the CPU build
    (and where vLLM finds no accelerator: a loader used outside an engine)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() or current_platform.is_unspecified():
        return torch.device("cpu")
    return torch.device(current_platform.current_device())


class _WeightsAt:
    """``model_config`` as ``get_all_weights`` reads it, with ``model``
    the URL of the weights."""

    def __init__(self, model_config: Any, url: str) -> None:
        self._config = model_config
        self.model = url

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


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
