"""Two DDP ranks (gloo, on loopback) record into one store."""
import textwrap

import numpy as np
import zarr

from ranks import PREAMBLE, run_ranks
from tensortape.analysis import open_run

WORKER = textwrap.dedent("""
    import os, sys, time
    import numpy as np, torch, torch.distributed as dist
    from torch import nn
    from tensortape.recorder import Recorder
    store, out, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(3)]
    time.sleep(delay * rank)          # rank 1 arrives late: no rank may undo another's work
    try:
        with Recorder(model, store, layers=["0", "2"], tensors_every=1, stats_every=1) as rec:
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
    assert run_ranks(worker, store, out, delay, world=world, timeout=120) == [0] * world
    return [(out / f"result{rank}").read_text() for rank in range(world)]


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


FSDP_WORKER = PREAMBLE + textwrap.dedent("""
    from torch.distributed.fsdp import fully_shard
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    fully_shard(model[0]); fully_shard(model[2]); fully_shard(model)
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(2)]
    try:
        with Recorder(model, store, layers=["0", "2"], tensors_every=1,
                      capture=("activations", "gradients", "weights", "weight_grads"), stats_every=1) as rec:
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


NAN_WORKER = PREAMBLE + textwrap.dedent("""
    inner = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model = nn.parallel.DistributedDataParallel(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []                                  # plain hooks: (step, layer, kind, NaN count)
    step = {"i": None}
    for name in ("0", "2"):
        mod = inner.get_submodule(name)
        mod.register_forward_hook(lambda m, a, o, name=name: seen.append(
            (step["i"], name, "activations", int(o.isnan().sum()))))
        mod.register_full_backward_hook(lambda m, gi, go, name=name: seen.append(
            (step["i"], name, "gradients", int(go[0].isnan().sum()))))
    with Recorder(model, store, layers=["0", "2"], tensors_every=1, stats_every=1) as rec:
        for i in range(6):
            step["i"] = i
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + i))
            if rank == int(os.environ["NAN_RANK"]) and i == int(os.environ["NAN_STEP"]):
                x[1, 2] = float("nan")
            with rec.step(i):
                model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    json.dump(seen, open(f"{out}/seen{rank}.json", "w"))
    open(f"{out}/result{rank}", "w").write("ok")
    dist.destroy_process_group()
""")


def test_four_ranks_are_one_run_and_the_first_nan_names_its_rank(tmp_path, monkeypatch):
    """Rank 2 alone feeds a NaN at step 3; DDP's all-reduce then spreads it to every
    rank's weights.  The run reads as one: statistics carry a ``rank`` dimension,
    ``first_nonfinite`` orders events across ranks and names rank 2, and ``nan``
    and ``info`` say so.  The oracle is each rank's plain hooks."""
    import json

    from click.testing import CliRunner

    from tensortape.cli import cli
    monkeypatch.setenv("NAN_RANK", "2")
    monkeypatch.setenv("NAN_STEP", "3")
    store = str(tmp_path / "run.zarr")
    assert _run_ranks(store, tmp_path, 0, world=4, worker=NAN_WORKER) == ["ok"] * 4
    seen = {r: json.loads((tmp_path / f"seen{r}.json").read_text()) for r in range(4)}
    # the oracle's order: step, forward before backward, execution order, then rank
    order = {"activations": 0, "gradients": 1}
    bad = sorted((s, order[k], i, r, layer, k) for r in range(4)
                 for i, (s, layer, k, n) in enumerate(seen[r]) if n)
    run = open_run(store)
    assert run.ranks == [0, 1, 2, 3]
    first = run.first_nonfinite()
    assert (first.step, first.rank, first.layer, first.kind) == (3, 2, "0", "activations")
    assert (first.step, first.rank, first.layer, first.kind) == tuple(
        bad[0][i] for i in (0, 3, 4, 5))
    got = [(e.step, e.rank, e.layer, e.kind) for e in run.events]
    assert sorted(set(got)) == sorted({(s, r, layer, k) for s, _, _, r, layer, k in bad})
    assert got[:2] == [(3, 2, "0", "activations"), (3, 2, "2", "activations")]
    ds = run.stats()
    assert ds.sizes["rank"] == 4 and ds["rank"].values.tolist() == [0, 1, 2, 3]
    for r in range(4):
        nans = {(s, layer): n for s, layer, k, n in seen[r] if k == "activations"}
        for (s, layer), n in nans.items():
            assert int(ds["nan"].sel(rank=r, step=s, layer=layer)) == n, (r, s, layer)
        one = run.stats(rank=r).compute()
        np.testing.assert_array_equal(ds["mean"].sel(rank=r).values, one["mean"].values)
    assert run.histogram("0").sizes["rank"] == 4
    out = CliRunner().invoke(cli, ["nan", store])
    assert out.exit_code == 1 and "step 3 on rank 2, layer 0, activations" in out.output, out.output
    out = CliRunner().invoke(cli, ["info", store])
    assert out.exit_code == 0 and "first at step 3 on rank 2" in out.output, out.output
    assert all(f"\n{r} " in out.output or f" {r} " in out.output for r in range(4))
    out = CliRunner().invoke(cli, ["compare", store, store, "--rank", "2"])
    assert out.exit_code == 0 and "no divergence" in out.output, out.output
