"""NCCL communicators with fewer CTAs under the overlapped TP schedule (issue #26), 2 GPUs.

Interleaved A/B (``sparsetp.bench.tp._interleaved``): TP=1 (a one-rank group) and TP=2 with the
default communicator and with ``ProcessGroupNCCL.Options().config.max_ctas`` in ``$CTAS``, for
the ``gpu2`` preset's MLP and block, with and without SP, fwd and fwd+bwd. Believe it when
``tests/torch_overlap_test.py`` passes. Results: ``benchmarks/results/tp_nccl_ctas_ab_h200x2.json``.

    CTAS=8,16,32 PYTHONPATH=$PWD python benchmarks/tp_nccl_ctas_ab.py OUT_JSON [rounds]
"""
import json
import os
import sys
import time
import traceback

CTAS = [int(x) for x in os.environ.get("CTAS", "2,4,8,16").split(",")]


def init_ranks(rank: int, world: int, port: int, ctas=()):
    """This rank's NCCL set-up as the TP bench makes it (``sparsetp.bench.tp._torch_rank``'s
    environment): ``(device, default TP group, {c: group with max_ctas=c}, one-rank group)``."""
    import datetime  # noqa: PLC0415

    from sparsetp.bench import tp as T  # noqa: PLC0415  (imports no torch)

    # Before CUDA and NCCL start in this process (the bench sets the same).
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    for k, v in T._GPU_ENV.items():
        os.environ.setdefault(k, v)
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    group = dist.new_group(list(range(world)))
    limited = {}
    for c in ctas:
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.max_ctas = c
        limited[c] = dist.new_group(list(range(world)), pg_options=opts)
    # new_group is collective: every rank creates every one-rank group, keeps its own.
    solo = [dist.new_group([r]) for r in range(world)][rank]
    return torch.device("cuda", rank), group, limited, solo


def rank_main(rank, world, port, out, rounds):
    import torch
    import torch.distributed as dist

    from sparsetp.bench import tp as T

    device, default, limited, solo = init_ranks(rank, world, port, CTAS)
    groups = {"default": default, **{f"ctas{c}": g for c, g in limited.items()}}
    spec = T.resolve_spec("gpu2", world, "cuda")
    rows = []
    for model in ("mlp", "block"):
        for sp in (False, True):
            gen, x, dy = T._bench_inputs(spec, device)
            models = {"tp1": T._tp_model(model, spec, solo, device, gen, False, True, None)}
            for name, g in groups.items():
                models[name] = T._tp_model(model, spec, g, device, gen, sp, True, None)
            if sp:
                # SP arms take this rank's token shard; tp1 the whole sequence, so time tp1
                # separately on the full input.
                xs, dys = T._seq_shards(groups["default"], x, dy)
                tp1 = models.pop("tp1")
            row = dict(model=model, sequence_parallel=sp)
            for mode in ("fwd", "fwd_bwd"):
                if sp:
                    row[mode] = T._interleaved(models, xs, dys, device, rounds,
                                               groups["default"], mode=mode)
                    row[mode + "_tp1"] = T._interleaved({"tp1": tp1}, x, dy, device, rounds,
                                                        groups["default"], mode=mode)
                else:
                    row[mode] = T._interleaved(models, x, dy, device, rounds,
                                               groups["default"], mode=mode)
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
            models = tp1 = None
            torch.cuda.empty_cache()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(dict(ctas=CTAS, rows=rows, torch=torch.__version__,
                           nccl=".".join(map(str, torch.cuda.nccl.version()))), f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def run_two_ranks(rank_main, port: int, default_rounds: int) -> None:
    """The 2-GPU lab scripts' entry point: ``rank_main(rank, 2, port, OUT_JSON, rounds)`` on two
    spawned ranks, from ``argv`` ``OUT_JSON [rounds]``; exit status 1 with the traceback on
    failure."""
    import torch.multiprocessing as mp
    try:
        out = sys.argv[1]
        rounds = int(sys.argv[2]) if len(sys.argv) > 2 else default_rounds
        t = time.time()
        mp.spawn(rank_main, args=(2, port, out, rounds), nprocs=2, join=True)
        print(f"done in {time.time() - t:.0f} s")
    except Exception:
        traceback.print_exc()
        sys.exit(1)


if __name__ == "__main__":
    run_two_ranks(rank_main, 29511, 9)
