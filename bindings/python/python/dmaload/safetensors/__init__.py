"""safetensors files into NumPy arrays or PyTorch tensors, at disk speed.

A drop-in for ``safetensors.numpy.load_file`` / ``safetensors.torch.load_file``
and ``safetensors.safe_open``::

    from dmaload.safetensors import load_file          # or: safe_open
    tensors = load_file("model.safetensors", framework="pt")

Each file is loaded whole, with the GIL released, into one :class:`dmaload.Buffer`
(memfd memory, direct I/O where the filesystem allows), and every tensor is
a view of that buffer: no per-tensor copy. The views keep the buffer alive;
the buffer is freed when the last of them goes, and its memory is never
reused while any view exists (``Buffer.close()`` refuses then).

``path`` may be a file, a ``*.safetensors.index.json`` or a directory (its
``model.safetensors.index.json``, else all its ``*.safetensors`` files): the
shards are loaded concurrently. It may also be an object URL:
``s3://BUCKET/KEY``, an index object, or a prefix ``s3://BUCKET/DIR/`` (its
``model.safetensors.index.json``, else its ``model.safetensors``), each
shard loaded once into host memory, or with ``device="cuda:N"`` received
through the staging ring into the device; see docs/object-storage.md. An index's ``weight_map`` is checked before
anything is loaded (see ``shard_paths``), then against the shards'
headers before their data (the core's ``tensor_index``), and against the loaded
shards again.

The header is untrusted input: anything malformed raises
:class:`dmaload.SafetensorError` saying what is wrong and at which byte.

Dtypes (all that safetensors defines):

========================  =========================  ==================================
safetensors               NumPy (``framework="np"``)   PyTorch (``framework="pt"``)
========================  =========================  ==================================
BOOL, U8..U64, I8..I64,   the same type               the same type (U16/U32/U64 need
F16, F32, F64, C64                                    torch >= 2.3)
BF16                      ``ml_dtypes.bfloat16`` if   ``torch.bfloat16``
                          installed, else ``uint16``
                          (the raw bits)
F8_E4M3, F8_E5M2,         ``ml_dtypes`` float8 type   ``torch.float8_*`` (torch >= 2.1;
F8_E4M3FNUZ,              if installed, else          E8M0 needs ``float8_e8m0fnu``)
F8_E5M2FNUZ, F8_E8M0      ``uint8`` (raw bits)
F4                        ``uint8``, 1-D raw bytes    ``float4_e2m1fn_x2`` (last dim
                          (two values per byte)       halved) if available, else raw
F6_E2M3, F6_E3M2          ``uint8``, 1-D raw bytes    ``uint8``, 1-D raw bytes
========================  =========================  ==================================

Any dtype the framework lacks comes back as its raw bytes (uint8) rather
than failing. A tensor whose offset is not a multiple of its element size
(never the case in files written by safetensors) is copied for PyTorch,
which requires aligned storage; NumPy views it in place.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, TypeAlias, TypeGuard, Union, Unpack, get_args

from .. import _dmaload
from .._cache import Cache, load_cached, socket_for
from .._dmaload import Buffer, SafetensorError
from .._header import Header, TensorInfo
from .._options import Destination, LoadOptions, Size, native_options
from .._progress import Progress, resolve
from .._report import LoadReport
from . import _collective, _device, _group
from ._file import _File, _product
from ._collective import DEFAULT_WINDOW, CollectiveLoadError, TensorFilter

__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_WINDOW",
    "CollectiveLoadError",
    "Header",
    "SafeOpen",
    "SafetensorError",
    "TensorInfo",
    "TensorFilter",
    "TensorSlice",
    "iter_tensors",
    "load_file",
    "release_staging",
    "safe_open",
    "shard_paths",
]


def release_staging() -> int:
    """Frees the pinned staging rings that device loads (``device="cuda:N"``)
    keep for the next load in this process, one per device, so that a model
    loaded file by file pins its ring once; returns the bytes freed. Loads
    after it pin a new ring."""
    return _dmaload.release_staging()

Framework: TypeAlias = Literal["np", "numpy", "pt", "torch"]
StrPath: TypeAlias = Union[str, "os.PathLike[str]"]
Paths: TypeAlias = Union[StrPath, Sequence[StrPath]]
Backend: TypeAlias = Literal["mmap", "pread", None]
"""safetensors 0.8's ``backend=``: accepted, and the same load either way."""
"""A model path (a file, an index or a directory) or a list of shard files."""

def _catchable_as_upstreams() -> None:
    """Where safetensors is installed, ``except safetensors.SafetensorError``
    catches ours too, as code written for safetensors expects of a drop-in:
    our ``SafetensorError`` (a ``ValueError`` the native module raises) gains
    safetensors' class as a second base. Both derive from ``Exception``
    alone, so the instance layouts agree; should a release of safetensors
    change that, the class stays as it was."""
    try:
        from safetensors import SafetensorError as upstream
    except ImportError:
        return
    if not issubclass(SafetensorError, upstream):
        try:
            SafetensorError.__bases__ = (ValueError, upstream)
        except TypeError:
            pass


_catchable_as_upstreams()

MAX_INDEX_LEN = _dmaload.MAX_HEADER_LEN
"""The largest index read (bytes): an index is untrusted, as a header is."""
DEFAULT_CONCURRENCY = 4


def shard_paths(path: Paths) -> tuple[list[Path], dict[str, str] | None]:
    """The files a model path stands for, and the index's weight map (if any).

    Local models only (an ``s3://`` URL is a ``ValueError``: ``load_file``
    and ``safe_open`` resolve those). A list (or tuple) is those shard files, with no index (a tensor in two
    of them is an error when they are loaded); a file is itself; a ``*.json`` is an index whose ``weight_map`` names
    the shards (relative to the index); a directory is its
    ``model.safetensors.index.json`` (or its only ``*.safetensors.index.json`` file)
    else all of its ``*.safetensors`` files in name order. A directory with
    several other index files (a diffusers model's variants, say) is an
    error naming them: which one is meant is the caller's to say.

    The core resolves it (``dmaload::format::model``, as ``dmaload load
    MODEL_DIR`` does) and checks the index before anything is loaded: it
    must be a regular file (``OSError`` EINVAL otherwise) of at most
    ``MAX_INDEX_LEN`` bytes of JSON with no key twice in an object, and
    its ``weight_map`` a non-empty map of tensor name to file name. A value
    that is absolute, contains ``..``, names no file (empty, ``.``) or
    contains NUL is refused naming the tensor and the value, and a shard
    that does not exist is ``FileNotFoundError``. The reference loaders
    (transformers) join each value to the index's directory unchecked.
    Shards may be symlinks (the Hugging Face cache links into
    ``../../blobs``): the rule is about the names in the index, not where
    links lead. Two spellings of one shard (``./a.safetensors``) are one.
    """
    if _is_object_url(path):
        raise ValueError(f"{path}: shard_paths resolves local models; load_file and safe_open take s3:// URLs")
    if isinstance(path, (list, tuple)):
        if not path:
            raise ValueError("an empty list of shard files")
        return [Path(os.fspath(f)) for f in path], None
    shards, weight_map = _dmaload.resolve_model(os.fspath(path))  # type: ignore[arg-type]  # a str or PathLike
    return [Path(f) for f in shards], (dict(weight_map) if weight_map is not None else None)


def _is_object_url(path: object) -> TypeGuard[str]:
    """Whether ``path`` names a model in object storage (``s3://...``)."""
    return isinstance(path, str) and path.startswith("s3://")


def _framework(framework: str) -> str:
    if framework in ("np", "numpy"):
        return "np"
    if framework in ("pt", "torch"):
        return "pt"
    raise ValueError(f"unsupported framework {framework!r} (expected 'np' or 'pt')")


def _check_device(framework: str, device: Any, options: dict[str, Any]) -> None:
    if framework == "np" and _device.is_device(device):
        raise ValueError(f"framework='np' loads to the cpu only, not device={device!r}")
    to = options.get("to")
    if to is not None and to not in get_args(Destination):
        raise ValueError(
            f"to={to!r}: these loaders choose a device with device= (device='cuda:N'); "
            f"to= picks the host memory of a cpu load ({', '.join(get_args(Destination))})"
        )


def _check_backend(backend: Any) -> None:
    if backend not in get_args(Backend):
        raise ValueError(f"backend must be 'mmap' or 'pread' (both read the same tensors here), not {backend!r}")


def _check_concurrency(concurrency: Any) -> None:
    if isinstance(concurrency, bool) or not isinstance(concurrency, int):
        raise TypeError(f"concurrency must be an int, not {type(concurrency).__name__}")
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, not {concurrency}")


def _load_files(
    paths: Sequence[StrPath], progress: Progress, concurrency: int, options: dict[str, Any]
) -> list[_File]:
    if not paths:
        return []
    desc = os.path.basename(os.fspath(paths[0])) if len(paths) == 1 else f"{len(paths)} files"
    callback, finish = resolve(progress, desc)
    try:
        loaded = _dmaload.load_safetensors(
            [os.fspath(p) for p in paths],
            concurrency=concurrency,
            options=native_options(options),
            progress=callback,
        )
    finally:
        finish()
    return [_File(buffer, header) for buffer, header in loaded]


def _load_files_cached(paths: Sequence[Path | str], socket: str, options: dict[str, Any]) -> list[_File]:
    """Each file whole from the cache service at ``socket`` (or loaded
    directly without one); its header parsed from the bytes received."""
    files = []
    for path in paths:
        buffer = load_cached(os.fspath(path), socket, native_options(options))
        with memoryview(buffer) as view:
            n = int.from_bytes(view[:8], "little") if len(view) >= 8 else 0
            head = bytes(view[: 8 + min(n, _dmaload.MAX_HEADER_LEN)])
        try:
            header = _dmaload.parse_safetensors_header(head, len(buffer))
        except SafetensorError as exc:
            raise SafetensorError(f"{path}: invalid safetensors file: {exc}") from None
        files.append(_File(buffer, header))
    return files


class SafeOpen:
    """A loaded safetensors file (or sharded model), like ``safetensors.safe_open``.

    The files are loaded when it is opened; ``keys()``, ``metadata()``,
    ``get_tensor()`` and ``get_slice()`` then only build views. Leaving the ``with`` block drops
    this object's hold on the buffers: tensors taken from it stay valid and
    keep their buffer alive.
    """

    def __init__(
        self,
        path: Paths,
        framework: Framework = "np",
        device: Any = "cpu",
        *,
        progress: Progress = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        cache: Cache = None,
        process_group: Any = None,
        tensor_filter: TensorFilter = None,
        window: Size | None = None,
        **options: Unpack[LoadOptions],
    ) -> None:
        self._framework = _framework(framework)
        # safetensors reads device=None as the CPU.
        device = "cpu" if device is None else device
        _check_device(self._framework, device, dict(options))
        _check_concurrency(concurrency)
        self._device = device
        self._closed = False
        # Tensors of a collective or filtered load, each read by one rank.
        self._loaded: dict[str, Any] | None = None
        streamed = process_group is not None or tensor_filter is not None
        sources: list[_group.Source]
        # A model in object storage: a URL, or a list of shard URLs (as vLLM lists them).
        objects = path if _is_object_url(path) else _object_shards(path)
        if objects is not None:
            if not streamed:
                self._open_objects(objects, device, progress, cache, dict(options))
                return
            # Shared by a group or filtered: a stream's windows, each
            # received by ranged GETs into its buffer.
            name = objects if isinstance(objects, str) else objects[0]
            _refuse_for_objects(name, cache=cache is not None)
            sources, weight_map = _object_model(objects)
            paths: list[Path] = []
        else:
            paths, weight_map = shard_paths(path)
            sources = list(paths)
        socket = socket_for(cache)
        if streamed:
            _check_torch(self._framework, process_group, tensor_filter)
        if socket is None and streamed:
            with _collective.Stream(
                sources,
                weight_map,
                device,
                process_group=process_group,
                tensor_filter=tensor_filter,
                window=window,
                progress=progress,
                options=dict(options),
            ) as stream:
                self._loaded = dict(stream)
                self._files = []
                self._infos = {t.name: t for h in stream.headers for t in h.tensors if t.name in self._loaded}
                self._metadata = stream.headers[0].metadata if stream.headers else None
            return
        if len(paths) > 1 or weight_map is not None:
            # Shards that disagree with each other or the index fail here,
            # from their headers, not after minutes of loading.
            headers = [_dmaload.open_safetensors(os.fspath(p)) for p in paths]
            _dmaload.tensor_index([(h.path, [t.name for t in h.header.tensors]) for h in headers], weight_map)
        on_device = self._framework == "pt" and _device.is_device(device)
        if on_device:
            self._files = _device.load_files(paths, device, progress, dict(options), socket)
        elif socket is not None:
            self._files = _load_files_cached(paths, socket, dict(options))
        else:
            self._files = _load_files(paths, progress, concurrency, dict(options))
        tables = [(f.path, list(f.tensors)) for f in self._files]
        self._index = {name: self._files[i] for name, i in _dmaload.tensor_index(tables, weight_map).items()}
        if tensor_filter is not None:
            # From the cache service's memory, where reading is mapping.
            wants = _collective.wants(tensor_filter)
            self._index = {name: f for name, f in self._index.items() if wants(name)}
        self._infos = {name: f.tensors[name] for name, f in self._index.items()}
        self._metadata = self._files[0].metadata if self._files else None

    def _open_objects(
        self,
        url: str | list[str],
        device: Any,
        progress: Progress,
        cache: Cache,
        options: dict[str, Any],
    ) -> None:
        """A model in object storage (``s3://BUCKET/KEY``, ``.../INDEX.json``,
        a prefix ``s3://BUCKET/model/`` or a list of shard URLs), resolved by the core as a
        local model is; each shard object loaded once into host memory, or
        onto ``device`` through the staged path as a file is. With
        ``cache=``, the cache service reads each shard (and keeps it under
        its ETag) and hands host memory its copy, or copies it into the
        device memory itself."""
        on_device = self._framework == "pt" and _device.is_device(device)
        name = url if isinstance(url, str) else url[0]
        _refuse_for_objects(name, verify_on_device=on_device and bool(options.get("verify")))
        urls, weight_map = _object_model(url)
        socket = socket_for(cache)
        if on_device:
            self._files = _device.load_files(urls, device, progress, options, socket)
        elif socket is not None:
            self._files = _load_files_cached(urls, socket, options)
        else:
            self._files = _load_files(urls, progress, DEFAULT_CONCURRENCY, options)
        tables = [(f.path, list(f.tensors)) for f in self._files]
        self._index = {name: self._files[i] for name, i in _dmaload.tensor_index(tables, weight_map).items()}
        self._infos = {name: f.tensors[name] for name, f in self._index.items()}
        self._metadata = self._files[0].metadata if self._files else None

    def __enter__(self) -> SafeOpen:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drops this object's references; tensors already taken stay valid."""
        self._files = []
        self._index = {}
        self._infos = {}
        self._loaded = None
        self._closed = True

    def _check(self) -> None:
        if self._closed:
            raise SafetensorError("operation on a closed safe_open")

    def keys(self) -> list[str]:
        """Tensor names, sorted (as safetensors returns them)."""
        self._check()
        return sorted(self._infos)

    def offset_keys(self) -> list[str]:
        """Tensor names in the order of their data in the files."""
        self._check()
        if self._loaded is not None:
            return list(self._loaded)
        return [name for f in self._files for name in f.tensors if name in self._infos]

    def metadata(self) -> dict[str, str] | None:
        """The ``__metadata__`` of the (first) file, or None."""
        self._check()
        return self._metadata

    def tensor_info(self, name: str) -> TensorInfo:
        """The :class:`TensorInfo` of a tensor: name, dtype, shape, and
        ``begin``/``end`` offsets relative to its file's data section. It
        unpacks like the tuple earlier versions returned:
        ``name, dtype, shape, begin, end = f.tensor_info(name)``."""
        self._check()
        try:
            return self._infos[name]
        except KeyError:
            raise KeyError(f"no tensor named {name!r}") from None

    def get_tensor(self, name: str) -> Any:
        """The tensor called ``name``: a view of the loaded buffer."""
        self._check()
        info = self.tensor_info(name)
        if self._loaded is not None:
            return self._loaded[info.name]
        t = self._index[name].tensor(name, self._framework)
        if self._framework == "pt" and str(self._device) != "cpu":
            t = t.to(self._device)
        return t

    def get_slice(self, name: str) -> TensorSlice:
        """The tensor called ``name``, to be indexed (``f.get_slice(name)[:, :8]``),
        as ``safetensors``' ``get_slice`` gives it."""
        self._check()
        return TensorSlice(self.get_tensor(name), self.tensor_info(name), self._framework)

    def get_tensors(self) -> dict[str, Any]:
        """All tensors, in file order."""
        return {name: self.get_tensor(name) for name in self.offset_keys()}

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._infos)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    @property
    def buffers(self) -> list[Buffer]:
        """The loaded buffers, one per file (none for a collective or
        filtered load, whose tensors are views of window buffers)."""
        return [f.buffer for f in self._files if f.buffer is not None]

    @property
    def reports(self) -> list[LoadReport]:
        """The load reports, one per file (none for a collective or
        filtered load)."""
        return [f.report for f in self._files]


class TensorSlice:
    """A tensor of a :class:`SafeOpen` whose part is chosen by indexing, like
    ``safetensors``' slice object: ``get_shape()``, ``get_dtype()`` (the
    safetensors name, e.g. ``"BF16"``) and ``[...]``. The file is already
    loaded, so indexing returns a view of the tensor (NumPy or PyTorch
    indexing: steps, negative indices, ``...`` and integers all work). As
    in safetensors, a NumPy slice refuses indices past a dimension with a
    ``SafetensorError`` (PyTorch's indexing, which safetensors uses for
    ``"pt"``, clamps or raises ``IndexError``)."""

    def __init__(self, tensor: Any, info: TensorInfo, framework: str = "np") -> None:
        self._tensor = tensor
        self._info = info
        self._framework = framework

    def get_shape(self) -> list[int]:
        """The tensor's shape."""
        return list(self._info.shape)

    def get_dtype(self) -> str:
        """The tensor's safetensors dtype name."""
        return self._info.dtype

    def __getitem__(self, key: Any) -> Any:
        if self._framework == "np":
            _check_slice(key, self._info.shape)
        key = key if isinstance(key, tuple) else (key,)
        # With an Ellipsis, NumPy gives an array even where all axes are
        # indexed (a 0-d array, as safetensors gives, not a NumPy scalar).
        if not any(k is Ellipsis for k in key):
            key = (*key, Ellipsis)
        return self._tensor[key]


def _check_slice(key: Any, shape: tuple[int, ...]) -> None:
    """Refuses, with safetensors' own messages, the indices safetensors
    refuses where NumPy and PyTorch would clamp, give an empty result or
    raise ``IndexError``: a non-empty list, an integer or a slice start at
    or past a dimension's end, a slice stop past it. Other indexing (steps,
    negative slice bounds, arrays) is left to the framework. A tensor with
    no elements is not checked."""
    if isinstance(key, list):
        if key:
            raise SafetensorError("Non empty lists are not implemented")
        return
    if _product(shape) == 0:
        return
    items = key if isinstance(key, tuple) else (key,)
    if sum(k is Ellipsis for k in items) > 1:
        return  # the framework's error
    explicit = len(items) - sum(k is Ellipsis for k in items)
    expanded: list[Any] = []
    for k in items:
        expanded.extend([slice(None)] * max(len(shape) - explicit, 0) if k is Ellipsis else [k])
    if len(expanded) > len(shape):
        return  # too many indices: the framework's error
    ranges: list[tuple[int, int] | None] = []
    for dim, k in enumerate(expanded):
        size = shape[dim]
        if isinstance(k, int) and not isinstance(k, bool):
            if k < -size:
                raise SafetensorError(f"Invalid index {k} for dimension {dim} of size {size}")
            at = k + size if k < 0 else k
            expanded[dim] = at
            ranges.append((at, at + 1))
        elif isinstance(k, slice) and all(b is None or (isinstance(b, int) and b >= 0) for b in (k.start, k.stop)):
            ranges.append((k.start or 0, size if k.stop is None else k.stop))
        else:
            ranges.append(None)

    def shown(k: Any) -> str:
        if not isinstance(k, slice):
            return str(k)
        bounds = f"{'' if k.start is None else k.start}:{'' if k.stop is None else k.stop}"
        return bounds if k.step in (None, 1) else f"{bounds}:{k.step}"

    # safetensors looks at the last dimension first.
    for dim in reversed(range(len(ranges))):
        bounds = ranges[dim]
        if bounds is None:
            continue
        (start, stop), size = bounds, shape[dim]
        if start >= size or stop > size:
            raise SafetensorError(
                f"Error during slicing [{', '.join(map(shown, expanded))}] with shape {list(shape)}: "
                f"index {start if start >= size else stop - 1} out of bounds for tensor dimension #{dim} of size {size}"
            )


def safe_open(
    path: Paths,
    framework: Framework = "np",
    device: Any = "cpu",
    *,
    progress: Progress = None,
    concurrency: int = DEFAULT_CONCURRENCY,
    cache: Cache = None,
    process_group: Any = None,
    tensor_filter: TensorFilter = None,
    window: Size | None = None,
    backend: Backend = None,
    **options: Unpack[LoadOptions],
) -> SafeOpen:
    """Opens (loads) a safetensors file or sharded model; see :class:`SafeOpen`
    and, for ``process_group``, ``tensor_filter``, ``window`` and
    ``backend``, :func:`load_file`."""
    _check_backend(backend)
    return SafeOpen(
        path,
        framework,
        device,
        progress=progress,
        concurrency=concurrency,
        cache=cache,
        process_group=process_group,
        tensor_filter=tensor_filter,
        window=window,
        **options,
    )


def load_file(
    path: Paths,
    device: Any = "cpu",
    framework: Framework = "np",
    *,
    progress: Progress = None,
    concurrency: int = DEFAULT_CONCURRENCY,
    cache: Cache = None,
    process_group: Any = None,
    tensor_filter: TensorFilter = None,
    window: Size | None = None,
    backend: Backend = None,
    **options: Unpack[LoadOptions],
) -> dict[str, Any]:
    """All tensors of a safetensors file (or sharded model) as a dict, like
    ``safetensors.numpy.load_file`` / ``safetensors.torch.load_file``.

    ``framework`` is ``"np"`` (NumPy arrays) or ``"pt"`` (PyTorch tensors);
    ``device="cuda:N"`` (PyTorch only) reads each file through a small pinned
    staging ring straight into one device allocation per file, never holding
    the model in host memory (see ``dmaload.safetensors._device``);
    ``device=None`` is the CPU, as in safetensors. See the module doc for
    dtypes and lifetimes.

    ``cache=True`` (or a socket path; ``DMALOAD_CACHE`` in the environment
    does the same) takes each file from the model-cache service (``dmaload
    serve``): on the CPU the same tensors, views of a private copy-on-write
    mapping of the service's memory, so writing to them changes nothing
    another process sees; on a device, the service's memory is read through
    the staging ring instead of the disk. Without a service the files load
    directly and a ``RuntimeWarning`` says why, once. An ``s3://`` model's
    shards come from the service too (it reads them with this process's
    presigned queries and keeps them under their ETags).

    ``process_group`` (a ``torch.distributed`` group; PyTorch only): every
    rank of the group calls this with the same path, each reads a disjoint
    1/N of the bytes and the ranks exchange them on the group's backend
    (gloo on the CPU, NCCL between GPUs, where ``device`` must be this
    rank's GPU), ``window`` bytes at a time (None: 64 MiB); a failure on any rank raises
    :class:`CollectiveLoadError` on every rank. ``tensor_filter`` (names,
    or a predicate on the name; PyTorch only) keeps only those tensors, and
    bytes that no rank wants are never read. See :func:`iter_tensors` and
    ``dmaload.safetensors._collective``. With ``cache=``, every rank maps
    the service's memory instead (no disk read to share).

    ``backend`` (``"mmap"`` or ``"pread"``, as safetensors 0.8 takes it) is
    accepted for compatibility and changes nothing: safetensors' backends
    choose how it reads, and dmaload reads with its own engine either way,
    giving the same tensors. Another value is a ``ValueError``.
    """
    with safe_open(
        path,
        framework,
        device,
        progress=progress,
        concurrency=concurrency,
        cache=cache,
        process_group=process_group,
        tensor_filter=tensor_filter,
        window=window,
        backend=backend,
        **options,
    ) as f:
        return f.get_tensors()


def iter_tensors(
    path: Paths,
    device: Any = "cpu",
    *,
    process_group: Any = None,
    tensor_filter: TensorFilter = None,
    window: Size | None = None,
    progress: Progress = None,
    cache: Cache = None,
    recycle: bool = False,
    **options: Unpack[LoadOptions],
) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` for each tensor of a safetensors file or sharded
    model (PyTorch tensors on ``device``), in file and data order, handed
    out while later ones are still being read: at most about five windows
    (three with a group) are held beyond the tensors the caller keeps. A window is a file's run
    of wanted tensors of up to ``window`` bytes (64 MiB by default; a
    larger tensor is a window of its own); without a group each window is
    one load whose tensors are handed out as soon as their bytes have
    arrived (waiting for them holds no GIL; Ctrl-C interrupts it).

    ``process_group`` shares the reads among the ranks of a
    ``torch.distributed`` group as :func:`load_file` says (every rank must
    consume the whole iterator); ``tensor_filter`` keeps only the tensors
    it names or accepts, never reading the others. With ``cache=`` (or
    ``DMALOAD_CACHE``), each file comes whole from the model-cache service
    and the group is not used.

    ``recycle=True`` reuses a ring of window buffers (five; three with a
    group) instead of new
    memory for each window (whose first touch costs more than the read
    where memory is slow to fault in): each tensor then stays valid only
    until the iterator hands out a tensor two windows later, so the caller
    must copy what it keeps, as a serving engine's ``load_weights`` does.

    An ``s3://`` model (a prefix, an index, one object, or a list of shard
    URLs) streams shard by
    shard: every shard's header is read first and checked against the
    index, then each shard is loaded whole (host memory, or ``device``
    through the staged path) and its tensors handed out before the next
    one is loaded, so about one shard is held beyond the tensors the caller
    keeps. With ``process_group``, ``tensor_filter``, ``window`` or
    ``recycle`` it streams in windows as a local model does, each window
    received by ranged GETs into its buffer (with a group, each rank GETs
    its 1/N and the ranks exchange the rest), and so with ``verify=True``,
    each object hashed against the ``B3SUMS`` or ``SHA256SUMS`` object
    beside it; ``cache`` is refused for it (docs/object-storage.md).

    ``verify=True`` hashes every byte of each file as its windows arrive
    (a filter's unwanted tensors are read too, not handed out) against its
    sums file; a mismatch raises :class:`CollectiveLoadError` at the
    file's last window. With a group, see docs/guarantees.md, "Multi-rank
    loads": what the ranks must share, and how long a lost rank holds the
    others."""
    _check_torch("pt", process_group, tensor_filter)
    url: str | list[str] | None = path if _is_object_url(path) else _object_shards(path)
    windowed = process_group is not None or tensor_filter is not None or window is not None or recycle
    sources: list[_group.Source]
    if url is not None:
        _refuse_for_objects(url if isinstance(url, str) else url[0], cache=cache is not None)
        # Verified, it streams in windows: their digests cover every byte
        # of each object, where the shard-by-shard path loads each data
        # section alone.
        if not windowed and not options.get("verify"):
            yield from _iter_objects(url, device, progress, dict(options))
            return
        # Shared by a group or filtered: the windows of a stream, each
        # received by ranged GETs into its buffer.
        sources, weight_map = _object_model(url)
    else:
        paths, weight_map = shard_paths(path)
        sources = list(paths)
    socket = socket_for(cache)
    if socket is not None:
        with safe_open(path, "pt", device, cache=socket, tensor_filter=tensor_filter, **options) as f:
            yield from ((name, f.get_tensor(name)) for name in f.offset_keys())
        return
    stream = _collective.Stream(
        sources,
        weight_map,
        device,
        process_group=process_group,
        tensor_filter=tensor_filter,
        window=window,
        progress=progress,
        recycle=recycle,
        options=dict(options),
    )
    with stream:
        yield from stream


def _refuse_for_objects(url: str, *, verify_on_device: bool = False, **given: bool) -> None:
    """Refuses, naming them, what an ``s3://`` model cannot take yet:
    each keyword of ``given`` that is true (an option given), and
    ``verify=True`` with a device (the staged path loads each data section
    alone, which a whole object's digest cannot check)."""
    unsupported = [f"{name}=" for name, on in given.items() if on]
    if verify_on_device:
        unsupported.append("verify=True with device=")
    if unsupported:
        raise ValueError(f"{url}: an s3:// model does not take {', '.join(unsupported)} so far (docs/object-storage.md)")


def _object_shards(path: Paths) -> list[str] | None:
    """The shard URLs of a list of ``s3://`` shards (a model without an
    index, as vLLM lists one), None for anything else; a list that mixes
    objects and files is a ``ValueError``."""
    if not isinstance(path, (list, tuple)) or not path or not _is_object_url(path[0]):
        return None
    if not all(_is_object_url(p) for p in path):
        raise ValueError("a list of shards is all s3:// URLs or all files, not both")
    return [str(p) for p in path]


def _object_model(url: str | list[str]) -> tuple[list[_group.Source], dict[str, str] | None]:
    """The shard URLs and weight map of a model in object storage: a URL
    the core resolves (an object, an index, a prefix), or a list of shard
    URLs without an index."""
    if isinstance(url, str):
        urls, pairs = _dmaload.resolve_model(url)
        return list(urls), (dict(pairs) if pairs is not None else None)
    return list(url), None


def _iter_objects(
    url: str | list[str], device: Any, progress: Progress, options: dict[str, Any]
) -> Iterator[tuple[str, Any]]:
    """:func:`iter_tensors` of a model in object storage (a URL the core
    resolves, or a list of shard URLs without an index), shard by shard:
    every shard's header read first (a ranged GET each) and checked against
    the others and the index, then each shard's data section received
    through the staged path (into a host tensor, or onto ``device``) from
    that same open and its tensors handed out in data order before the
    next shard is loaded."""
    urls, weight_map = _object_model(url)
    headers = [_dmaload.open_safetensors(u) for u in urls]
    _dmaload.tensor_index([(os.fsdecode(h.path), [t.name for t in h.header.tensors]) for h in headers], weight_map)
    for opened in headers:
        # From the open whose header was checked: a shard replaced since
        # is ESTALE, never a tensor the check did not see.
        (loaded,) = _device.load_opened([opened], device, progress, options)
        yield from ((name, loaded.tensor(name, "pt")) for name in loaded.tensors)


def _check_torch(framework: str, process_group: Any, tensor_filter: TensorFilter) -> None:
    if framework != "pt":
        raise ValueError("process_group= and tensor_filter= load PyTorch tensors: use framework='pt'")
    if process_group is not None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError("process_group= needs torch.distributed initialised (init_process_group)")

