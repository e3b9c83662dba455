"""dmaload's SGLang loader against SGLang's own DefaultModelLoader, on CPU.

Runs in the environment tests/engines/setup-sglang.sh makes (SGLang's wheel
with --no-deps, the torch it pins, and what its loader classes import);
ci.sh runs it. SGLang's world group is made as SGLang's own layer tests
make it (gloo, one rank), so the loaders run as in a one-rank engine.

What it cannot run on CPU: building SGLang's model classes. Their rotary
embedding needs SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1), whose
kernels (the CPU build of sgl-kernel) PyPI does not carry; without it they
import vLLM's CUDA ops. So the check is at the loader's output, which is
what a model's load_weights consumes: the same names, dtypes and bytes
from both loaders, for every source and step SGLang applies
(maybe_add_mtp_safetensors, a draft model's MTP layer). Serving a model
with --load-format dmaload runs on a GPU machine (bench/gpu-kit.sh engines,
serve_check.py sglang). test_sglang_models_build_on_cpu says which of the
two this machine can do.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sglang = pytest.importorskip("sglang")
torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from tiny_llama import make, make_mixtral  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_rank_world() -> Iterator[None]:
    """SGLang's runtime as one rank of an engine has it: published server
    arguments and a world group (gloo, one rank)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    from sglang.srt.distributed import parallel_state
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1, device="cpu"), role="test",
            ranks=SpawnRanks(world_rank=0))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    parallel_state.initialize_model_parallel(backend="gloo")
    print(f"\nSGLang {sglang.__version__}, torch {torch.__version__}")
    yield


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": make(root / "llama", layers=3, hidden=128, intermediate=256, shard_size="200KB"),
        "mixtral": make_mixtral(root / "mixtral", layers=2, experts=4, shard_size="150KB"),
        "glm4-moe-mtp": _glm4_moe_with_mtp(root / "glm4-moe-mtp"),
    }


def _glm4_moe_with_mtp(out: Path) -> Path:
    """A GLM-4 MoE checkpoint packaged as SGLang's maybe_add_mtp_safetensors
    works around: the MTP (speculative-decoding) layers in mtp.safetensors,
    which the index leaves out. Only the file layout and config matter to
    the loaders: the tensors are small and random."""
    out.mkdir()
    g = torch.Generator().manual_seed(3)
    main = {f"model.layers.{i}.mlp.experts.{e}.w": torch.randn(8, 16, generator=g).to(torch.bfloat16)
            for i in range(2) for e in range(2)}
    mtp = {f"model.mtp.layers.{i}.w": torch.randn(8, 16, generator=g).to(torch.bfloat16) for i in range(2)}
    safetensors_torch.save_file(main, out / "model.safetensors")
    safetensors_torch.save_file(mtp, out / "mtp.safetensors")
    index = {"metadata": {}, "weight_map": dict.fromkeys(main, "model.safetensors")}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "num_nextn_predict_layers": 2}
    (out / "config.json").write_text(json.dumps(config))
    return out


def _model_config(path: Path) -> Any:
    return SimpleNamespace(model_path=str(path), revision=None,
                           hf_config=SimpleNamespace(**json.loads((path / "config.json").read_text())))


def _all_weights(loader: Any, path: Path) -> dict[str, Any]:
    return {name: t.clone() for name, t in loader._get_all_weights(_model_config(path), torch.nn.Module())}


def _ours(**load_config: Any) -> Any:
    from sglang.srt.configs.load_config import LoadConfig

    from dmaload.engines.sglang import loader_class

    return loader_class()(LoadConfig(load_format=loader_class(), **load_config))


def _loaders(**load_config: Any) -> tuple[Any, Any]:
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader

    return _ours(**load_config), DefaultModelLoader(LoadConfig(load_format="safetensors", **load_config))


def _same(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert sorted(ours) == sorted(theirs)
    different = [n for n in theirs if ours[n].dtype != theirs[n].dtype or not torch.equal(ours[n], theirs[n])]
    assert not different, different


@pytest.mark.parametrize("name", ["llama", "mixtral", "glm4-moe-mtp"])
def test_the_loader_gives_what_sglangs_default_loader_gives(
    models: dict[str, Path], name: str, caplog: pytest.LogCaptureFixture
) -> None:
    ours_loader, theirs_loader = _loaders()
    with caplog.at_level("INFO", logger="sglang.dmaload"):
        ours = _all_weights(ours_loader, models[name])
    theirs = _all_weights(theirs_loader, models[name])
    _same(ours, theirs)
    assert "dmaload: loaded" in caplog.text  # dmaload read them
    if name == "glm4-moe-mtp":
        # The MTP file the index leaves out was read (by both).
        assert {"model.mtp.layers.0.w", "model.mtp.layers.1.w"} <= ours.keys()


def test_a_draft_model_gets_its_mtp_layer(models: dict[str, Path]) -> None:
    """SGLang's draft model (draft_model_idx) keeps one MTP layer, renamed
    to layer 0: SGLang's step, run on dmaload's tensors."""
    ours_loader, theirs_loader = _loaders(draft_model_idx=1)
    ours = _all_weights(ours_loader, models["glm4-moe-mtp"])
    theirs = _all_weights(theirs_loader, models["glm4-moe-mtp"])
    _same(ours, theirs)
    assert "model.mtp.layers.0.w" in ours and "model.mtp.layers.1.w" not in ours


def test_extra_config_is_checked_when_the_loader_is_made() -> None:
    from dmaload.engines import EXTRA_CONFIG_KEYS

    def make(extra: dict[str, Any]) -> Any:
        return _ours(model_loader_extra_config=extra)

    assert make({"window": "1M", "mode": "buffered"}).dmaload_config.options == {"mode": "buffered"}
    with pytest.raises(ValueError, match="unknown model_loader_extra_config key 'windw' for load format 'dmaload'") as err:
        make({"windw": "1M"})
    assert all(key in str(err.value) for key in EXTRA_CONFIG_KEYS)
    with pytest.raises(ValueError, match="fastest"):
        make({"mode": "fastest"})
    for key, value in [("enable_multithread_load", True), ("num_threads", 4)]:
        with pytest.raises(ValueError, match=f"'{key}' is refused with load format 'dmaload'"):
            make({key: value})


def test_sglang_models_build_on_cpu() -> None:
    """Whether this machine can build SGLang's Llama (and so run
    load_weights on it): SKIP with the exact failure where it cannot."""
    from transformers import LlamaConfig

    try:
        from sglang.srt.models.llama import LlamaForCausalLM

        LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, vocab_size=256))
    except ImportError as exc:
        pytest.skip(f"SKIP sglang load_weights on CPU: building SGLang's LlamaForCausalLM fails: {exc!r}")
