"""Property-based round trips (hypothesis): whatever a module returns (dtype, shape,
memory layout, nesting, NaN/Inf/-0/subnormals), each full tensor reads back
bit-exactly and its statistics count it exactly; a tensor whose dtype or rank
changes between steps is counted in ``dropped`` with its reason, and its statistics
are kept."""
import os
import tempfile
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensortape.analysis import open_run
from tensortape.recorder import Recorder

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
          torch.uint8, torch.bool, torch.complex64, torch.complex128]
LAYOUTS = ["contiguous", "transposed", "strided", "expanded", "channels_last"]
SUBNORMAL = {torch.float32: 1e-40, torch.float16: 6e-8, torch.bfloat16: 1e-40, torch.float64: 1e-310,
             torch.complex64: 1e-40, torch.complex128: 1e-310}


@st.composite
def specs(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=4)))
    layout = draw(st.sampled_from(LAYOUTS))
    return dtype, shape, layout, draw(st.integers(0, 2 ** 31))


def make(spec) -> torch.Tensor:
    """The tensor of a spec: values (specials included) and then a memory layout."""
    dtype, shape, layout, seed = spec
    g = torch.Generator().manual_seed(seed)

    def values(shape):
        if dtype == torch.bool:
            return torch.rand(shape, generator=g) > 0.5
        if not (dtype.is_floating_point or dtype.is_complex):
            return torch.randint(0, 200, shape, generator=g).to(dtype)
        t = (torch.randn(shape, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(
            -3, 4, shape, generator=g)).to(dtype)
        flat = t.view(-1)
        for v in (float("nan"), float("inf"), -float("inf"), -0.0, SUBNORMAL[dtype]):
            if flat.numel() and torch.rand(1, generator=g).item() < 0.4:
                flat[torch.randint(0, flat.numel(), (1,), generator=g)] = v
        return t

    if layout == "transposed" and len(shape) >= 2:
        return values((shape[1], shape[0], *shape[2:])).transpose(0, 1)
    if layout == "strided" and shape:
        return values((*shape[:-1], 2 * shape[-1]))[..., ::2]
    if layout == "expanded" and shape:
        return values((1, *shape[1:])).expand(shape)
    if layout == "channels_last" and len(shape) == 4:
        return values(shape).contiguous(memory_format=torch.channels_last)
    return values(shape)


structures = st.recursive(
    st.just(None),                                   # None: a tensor goes here
    lambda inner: st.one_of(st.lists(inner, min_size=1, max_size=3).map(tuple),
                            st.lists(inner, min_size=1, max_size=2),
                            st.dictionaries(st.sampled_from(["a", "b", "c"]), inner,
                                            min_size=1, max_size=3)),
    max_leaves=4)


def paths(structure, path=""):
    """The documented names of the tensors in an output: ``(root)``, or
    ``(root):`` and the dotted path (keys of a dict, indices of a sequence)."""
    if structure is None:
        yield path
    elif isinstance(structure, dict):
        for k, v in structure.items():
            yield from paths(v, f"{path}.{k}" if path else k)
    else:
        for i, v in enumerate(structure):
            yield from paths(v, f"{path}.{i}" if path else str(i))


def fill(structure, tensors):
    if structure is None:
        return next(tensors)
    if isinstance(structure, dict):
        return {k: fill(v, tensors) for k, v in structure.items()}
    out = [fill(v, tensors) for v in structure]
    return tuple(out) if isinstance(structure, tuple) else out


class Emit(torch.nn.Module):
    """Returns the next prepared output at each call."""

    def __init__(self, outputs):
        super().__init__()
        self.outputs = iter(outputs)

    def forward(self, x):
        return next(self.outputs)


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    if a.dtype.kind == "c":                  # complex: the bits of both parts
        a = a.view(f"f{a.itemsize // 2}")
    return a.view(f"u{a.itemsize}") if a.dtype.kind == "f" else a


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(structure=structures, data=st.data())
def test_any_output_round_trips_bit_exactly(structure, data, monkeypatch):
    monkeypatch.setenv("TENSORTAPE_COMPILE", "0")        # eager kernels: many dtypes, fast
    names = [f"(root):{p}" if p else "(root)" for p in paths(structure)]
    steps = 3
    first = [data.draw(specs()) for _ in names]
    per_step = [[s if i == 0 or data.draw(st.booleans()) else data.draw(specs())
                 for s in first] for i in range(steps)]     # some leaves change between steps
    outputs = [fill(structure, iter([make(s) for s in row])) for row in per_step]
    expected = [[make(s) for s in row] for row in per_step]
    with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "run.zarr")
        model = Emit(outputs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")              # the dtype-change warning
            with Recorder(model, store, layers="", capture="activations", tensors_every=1, stats_every=1) as rec:
                for _ in range(steps):
                    with rec.step(), torch.no_grad():
                        model(torch.zeros(1))
        run = open_run(store)
        stats = run.stats().compute()
        dropped = 0
        for j, name in enumerate(names):
            table = expected[0][j]
            for i in range(steps):
                t = expected[i][j]
                row = stats.sel(layer=name, step=i)
                assert int(row["count"]) == t.numel()
                if t.is_floating_point():
                    assert int(row["nan"]) == int(t.isnan().sum())
                    assert int(row["posinf"]) == int((t == float("inf")).sum())
                if t.dtype != table.dtype or t.dim() != table.dim():
                    dropped += 1
                    continue
                got = run.tensor(name, step=i).values
                want = (t.float() if t.dtype == torch.bfloat16 else t).numpy()
                assert got.shape == want.shape
                np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"{name} step {i}")
        assert run.dropped == dropped
        assert run.attrs["drop_reasons"].get("full tensor changed dtype or rank", 0) == dropped
