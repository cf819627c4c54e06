"""Do copy-engine transfers take the overlap's cost off the GEMMs? (issue #26), 2 GPUs.

The session-27 profiles (``tp_block_ab.py``) put most of the TP=2 block's remaining loss in GEMMs
that run slower beside the NCCL kernels of the collective matmuls (NCCL's send/recv and
reductions occupy SMs). torch's SymmetricMemory collective matmuls
(``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``) move the
pieces between GPUs through mapped peer memory. This probe times, forward only, the
sequence-parallel MLP's two layers at the ``gpu2`` shapes (T = 8192, d = 8192, ff = 32768, TP = 2,
bf16), interleaved rounds, median ms per call:

- ``gemm``: the local GEMM alone, the ceiling;
- ``plain``: NCCL all-gather then GEMM (column) / GEMM then NCCL reduce-scatter (row);
- ``ours``: sparsetp's collective matmul (``comm_chunks=2``: NCCL send/recv under the GEMM);
- ``symm``: torch's SymmetricMemory fused op.

and the largest difference of ``ours`` and ``symm`` from ``plain``.

    PYTHONPATH=$PWD python benchmarks/tp_symm_mem_probe.py OUT_JSON [rounds]
"""
import json
import time


def rank_main(rank, world, port, out, rounds):
    import torch
    import torch.distributed as dist
    from tp_nccl_ctas_ab import init_ranks  # benchmarks/, the script's own directory

    from sparsetp.backends.torch.layers import ColumnParallelLinear, RowParallelLinear

    device, group, _, _ = init_ranks(rank, world, port)
    name = group.group_name
    try:
        from torch.distributed import _symmetric_memory as symm_mem
        symm_mem.enable_symm_mem_for_group(name)
        symm_err = None
    except Exception as e:  # noqa: BLE001  (recorded: the probe's point is whether it runs)
        symm_err = f"{type(e).__name__}: {e}"
    t, d, ff = 8192, 8192, 32768
    dt = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(rank)
    col = ColumnParallelLinear(d, ff, bias=False, group=group, dtype=dt, device=device,
                               seed=None, sequence_parallel=True, comm_chunks=2)
    row = RowParallelLinear(ff, d, bias=False, group=group, dtype=dt, device=device, seed=None,
                            sequence_parallel=True, comm_chunks=2)
    with torch.no_grad():
        for lin in (col, row):
            lin.weight.normal_(0, lin.weight.shape[0] ** -0.5, generator=g)
    x_shard = torch.randn(t // world, d, generator=g, device=device, dtype=dt)
    h = torch.randn(t, ff // world, generator=g, device=device, dtype=dt)
    w1, w2 = col.weight.detach(), row.weight.detach()

    def col_plain():
        full = torch.empty(t, d, device=device, dtype=dt)
        dist.all_gather_into_tensor(full, x_shard, group=group)
        return full @ w1

    def row_plain():
        y = h @ w2
        out_ = torch.empty(t // world, d, device=device, dtype=dt)
        dist.reduce_scatter_tensor(out_, y, group=group)
        return out_

    def col_symm():
        got = torch.ops.symm_mem.fused_all_gather_matmul(x_shard, [w1], 0, name)
        return got[1][0]

    def row_symm():
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(h, w2, "sum", 0, name)

    full_x = torch.randn(t, d, generator=g, device=device, dtype=dt)
    arms = {
        "col": {"gemm": lambda: full_x @ w1, "plain": col_plain,
                "ours": lambda: col(x_shard[None])[0], "symm": col_symm},
        "row": {"gemm": lambda: h @ w2, "plain": row_plain,
                "ours": lambda: row(h[None])[0], "symm": row_symm},
    }
    report = dict(symm_enable_error=symm_err, torch=torch.__version__,
                  device=torch.cuda.get_device_name(), layers={})
    for layer, fns in arms.items():
        res = dict(errors={}, max_diff={})
        with torch.no_grad():
            ref = fns["plain"]()
            for arm, fn in list(fns.items()):
                try:
                    y = fn()
                    torch.cuda.synchronize()
                    if arm in ("ours", "symm"):
                        res["max_diff"][arm] = float((y.float() - ref.float()).abs().max())
                except Exception as e:  # noqa: BLE001
                    res["errors"][arm] = f"{type(e).__name__}: {str(e)[:300]}"
                    fns.pop(arm)
            per = {arm: [] for arm in fns}
            for _ in range(rounds):
                for arm, fn in fns.items():
                    torch.cuda.synchronize()
                    dist.barrier(group=group)
                    s = time.perf_counter()
                    for _ in range(8):
                        fn()
                    torch.cuda.synchronize()
                    per[arm].append((time.perf_counter() - s) / 8 * 1e3)
        res["ms"] = {arm: sorted(v)[len(v) // 2] for arm, v in per.items()}
        report["layers"][layer] = res
        if rank == 0:
            print(layer, json.dumps(res), flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from tp_nccl_ctas_ab import run_two_ranks  # benchmarks/, the script's own directory
    run_two_ranks(rank_main, 29514, 15)
