"""dmaload's collective load on a GPU: a group of one NCCL rank (what a
one-GPU machine can run) and no group, each tensor equal to safetensors'
own; bench/gpu-kit.sh engines runs it. (test_collective.py runs 2 and 4
ranks over gloo on any machine.)"""

import datetime
import sys
import tempfile
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed as dist

from dmaload.safetensors import iter_tensors, load_file

if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        g = torch.Generator().manual_seed(3)
        tensors = {f"t{i}": torch.randn(1000 + 77 * i, 513, generator=g).to(torch.bfloat16) for i in range(40)}
        path = Path(tmp) / "m.safetensors"
        safetensors.torch.save_file(tensors, path)
        dist.init_process_group(
            "nccl", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
        )
        torch.cuda.set_device(0)
        reference = safetensors.torch.load_file(path, device="cuda:0")
        for label, got in [
            ("nccl group", load_file(path, device="cuda:0", process_group=dist.group.WORLD, window="4M")),
            ("no group", dict(iter_tensors(path, device="cuda:0", window="4M"))),
            ("recycled", {n: t.clone() for n, t in iter_tensors(path, device="cuda:0", window="4M", recycle=True)}),
        ]:
            bad = [n for n in reference if not (got[n].device.type == "cuda" and got[n].equal(reference[n]))]
            if bad or got.keys() != reference.keys():
                sys.exit(f"{label}: {len(bad)} tensor(s) differ, e.g. {bad[:3]}")
            print(f"{label}: {len(got)} tensors equal safetensors' on cuda:0")
        dist.destroy_process_group()
