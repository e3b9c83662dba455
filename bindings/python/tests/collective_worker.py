"""One rank of a collective load, started N times by test_collective.py:
``python collective_worker.py RENDEZVOUS RANK WORLD SCENARIO MODEL [ARGS]``.

Prints one line ``RESULT {json}`` on success; on failure the exception and
exit status 1. Scenarios:

equal   every tensor equals safetensors' own (load_file and safe_open)
io      evicts the files from the page cache, loads, reports the bytes this
        process read from storage (/proc/self/io read_bytes)
filter  like io, each rank wanting the tensors ARGS[0] names (a JSON
        object of rank -> list of names), in windows of the default size;
        reports the bytes of the storages its tensors hold
fail    rank 1 loads with chunk_size=0, which its first read refuses
header  rank 1 loads the checkpoint ARGS[0] names instead (a broken header)
kill    rank 1 SIGKILLs itself when its first tensor arrives
quit    rank 1 stops iterating after its first tensor and exits
paths   each rank loads the checkpoint ARGS[rank] names (options: the JSON
        object ARGS[world], if given, or a list of each rank's); reports
        each tensor's byte sum and
        SHA-256
load_file like paths, through load_file (nothing comes back unless all of
        the load succeeded)
rewrite rank 0 rewrites the first file in place (same size, other bytes)
        once its first tensor arrives; the others go on loading
window  rank 1 passes another window than rank 0
stop    rank 1 stops itself (SIGSTOP) when its first tensor arrives: it
        neither answers nor closes a connection; the group's timeout is
        600 s, longer than the test waits
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import resource
import signal
import sys
import time

MEASURES = 3
"""Attempts at a load during which no rank took a major fault."""


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def main() -> None:
    rendezvous, rank, world, scenario, model, *args = sys.argv[1:]
    rank_i, world_i = int(rank), int(world)
    import safetensors.torch
    import torch
    import torch.distributed as dist

    import dmaload
    from dmaload.safetensors import iter_tensors, load_file, safe_open, shard_paths

    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank_i, world_size=world_i,
        timeout=datetime.timedelta(seconds=600 if scenario == "stop" else 30),
    )
    group = dist.group.WORLD
    paths, _ = shard_paths(model)
    window = "1M"
    result: dict[str, object] = {"rank": rank_i}
    if scenario == "equal":
        reference: dict[str, torch.Tensor] = {}
        for p in paths:
            reference.update(safetensors.torch.load_file(p))
        got = load_file(model, framework="pt", process_group=group, window=window)
        with safe_open(model, framework="pt", process_group=group, window=window) as f:
            opened = {name: f.get_tensor(name) for name in f.keys()}
        for tensors in (got, opened):
            assert tensors.keys() == reference.keys(), sorted(set(tensors) ^ set(reference))
            for name, ref in reference.items():
                t = tensors[name]
                assert (t.dtype, t.shape) == (ref.dtype, ref.shape), name
                assert t.contiguous().view(-1).view(torch.uint8).equal(ref.contiguous().view(-1).view(torch.uint8)), name
        result["tensors"] = len(got)
    elif scenario in ("io", "filter"):
        # One whole collective load first, so that what it imports or maps
        # lazily (the exchange's code pages too, which a machine under
        # memory pressure may have to read from the disk again) is not read
        # inside the measured load: one small tensor left the large
        # exchanges' paths cold, and a clean CI machine counted their pages.
        for _ in iter_tensors(model, process_group=group, window=window):
            pass
        wanted = set(json.loads(args[0])[rank]) if scenario == "filter" else None
        # A major fault during the load (a code page the kernel had
        # dropped) reads around it, up to read_ahead_kb (8 MiB on the CI
        # VM), into the same counter: such a load is measured again, all
        # ranks together, up to MEASURES times.
        for attempt in range(1, MEASURES + 1):
            for p in paths:
                dmaload.evict(p)
            # The barrier: no rank's reads start before every rank evicted.
            dist.barrier()
            before, faults = read_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_majflt
            names, digest, storages = [], 0, {}
            # filter: windows of the default size, each a whole shard here.
            measured = None if scenario == "filter" else window
            for name, t in iter_tensors(model, process_group=group, tensor_filter=wanted, window=measured):
                names.append(name)
                digest += int(t.contiguous().view(-1).view(torch.uint8).sum())
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            read = read_bytes() - before
            faulted = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults])
            dist.all_reduce(faulted)
            if int(faulted) == 0:
                break
        # held: the memory the tensors handed out keep alive.
        held = sum(storages.values())
        result.update(read=read, names=sorted(names), sum=digest, measures=attempt, major_faults=int(faulted), held=held)
    elif scenario in ("paths", "load_file"):
        options = json.loads(args[world_i]) if len(args) > world_i else {}
        if isinstance(options, list):  # each rank's own
            options = options[rank_i]
        if scenario == "paths":
            pairs = iter_tensors(args[rank_i], process_group=group, window=window, **options)
        else:
            loaded = load_file(args[rank_i], framework="pt", process_group=group, window=window, **options)
            pairs = iter(loaded.items())
        sums, sha256 = {}, {}
        for name, t in pairs:
            data = t.contiguous().view(-1).view(torch.uint8)
            sums[name] = int(data.sum())
            sha256[name] = hashlib.sha256(data.numpy().tobytes()).hexdigest()
        result.update(sums=sums, sha256=sha256)
    elif scenario == "rewrite":
        for i, (_name, _t) in enumerate(iter_tensors(model, process_group=group, window=window)):
            if rank_i == 0 and i == 0:
                # Once the readers wait for this consumer (they read at most
                # two windows ahead), so that no load is in flight to see
                # the write: the rewrite falls between two windows' loads.
                time.sleep(1)
                with open(paths[0], "r+b") as f:
                    size = f.seek(0, os.SEEK_END)
                    f.seek(size - (8 << 20))
                    tail = bytearray(f.read())
                    f.seek(size - (8 << 20))
                    f.write(bytes(b ^ 0xA5 for b in tail))
        result["finished"] = True
    elif scenario == "window":
        for _name, _t in iter_tensors(model, process_group=group, window="2M" if rank_i == 1 else window):
            pass
        result["finished"] = True
    elif scenario == "header":
        for _name, _t in iter_tensors(args[0] if rank_i == 1 else model, process_group=group, window=window):
            pass
        result["finished"] = True
    elif scenario in ("fail", "kill", "quit", "stop"):
        options = {"chunk_size": 0} if scenario == "fail" and rank_i == 1 else {}
        for _name, _t in iter_tensors(model, process_group=group, window=window, **options):
            if rank_i == 1 and scenario == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if rank_i == 1 and scenario == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if rank_i == 1 and scenario == "quit":
                raise SystemExit("rank 1 quits after its first tensor")
        result["finished"] = True
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
