"""Two DDP ranks (gloo, on loopback) record into one store."""
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import zarr

from analysis import open_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = textwrap.dedent("""
    import os, sys, time
    import numpy as np, torch, torch.distributed as dist
    from torch import nn
    from recorder import Recorder
    store, out, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(3)]
    time.sleep(delay * rank)          # rank 1 arrives late: no rank may undo another's work
    try:
        with Recorder(model, store, layers=["0", "2"]) as rec:
            for x in xs:
                with rec.step():
                    model(x).sum().backward()
        with torch.no_grad():
            np.save(f"{out}/expect{rank}.npy", np.stack([model.module[0](x).numpy() for x in xs]))
        result = "ok"
    except Exception as e:
        result = type(e).__name__
    open(f"{out}/result{rank}", "w").write(result)
    dist.destroy_process_group()
""")


def _run_ranks(store, out, delay, world=2, worker=WORKER):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), PYTHONPATH=ROOT)
        procs.append(subprocess.Popen([sys.executable, "-c", worker, store, str(out), str(delay)],
                                      env=env, cwd=ROOT))
    for p in procs:
        assert p.wait(timeout=120) == 0
    return [open(out / f"result{rank}").read() for rank in range(world)]


def test_two_ranks_record_into_one_store(tmp_path):
    store = str(tmp_path / "run.zarr")
    assert _run_ranks(store, tmp_path, delay=1.0) == ["ok", "ok"]
    run = open_run(store)
    assert run.ranks == [0, 1]
    assert zarr.open_group(store, mode="r").attrs["status"] == "complete"
    for rank in (0, 1):
        assert run.layers_of(rank=rank)[:2] == ["0", "2"]      # no DDP "module." prefix
        np.testing.assert_array_equal(run.tensor("0", rank=rank).values,
                                      np.load(tmp_path / f"expect{rank}.npy"))
    # mode="w-" applies to the run as a whole: every rank refuses the existing store, none hangs
    assert _run_ranks(store, tmp_path, delay=0.0) == ["StoreExistsError", "StoreExistsError"]
    assert open_run(store).ranks == [0, 1]


FSDP_WORKER = textwrap.dedent("""
    import sys
    import numpy as np, torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from recorder import Recorder
    store, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    fully_shard(model[0]); fully_shard(model[2]); fully_shard(model)
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(2)]
    try:
        with Recorder(model, store, layers=["0", "2"],
                      capture=("activations", "gradients", "weights", "weight_grads")) as rec:
            for x in xs:
                model.zero_grad()
                with rec.step():
                    model(x).sum().backward()
        np.save(f"{out}/grad{rank}.npy", model[0].weight.grad.full_tensor().numpy())
        np.save(f"{out}/weight{rank}.npy", model[0].weight.full_tensor().detach().numpy())
        result = "ok"
    except Exception as e:
        result = type(e).__name__
    open(f"{out}/result{rank}", "w").write(result)
    dist.destroy_process_group()
""")


def test_fsdp2_ranks_record_activations_and_their_shards(tmp_path):
    store = str(tmp_path / "fsdp.zarr")
    assert _run_ranks(store, tmp_path, delay=0.0, worker=FSDP_WORKER) == ["ok", "ok"]
    run = open_run(store)
    assert run.ranks == [0, 1]
    full_grad = np.load(tmp_path / "grad0.npy")
    shards = [run.tensor("0:weight", "weight_grads", step=1, rank=r).values for r in (0, 1)]
    assert [s.shape for s in shards] == [(4, 4), (4, 4)]          # each rank's own shard
    np.testing.assert_allclose(np.concatenate(shards), full_grad, rtol=1e-6)
    for r in (0, 1):                                               # weights as forward saw them
        np.testing.assert_array_equal(run.tensor("0:weight", "weights", step=1, rank=r).values,
                                      np.load(tmp_path / "weight0.npy"))
        assert run.tensor("0", step=0, rank=r).shape == (3, 8)
