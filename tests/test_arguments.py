"""One meaning per argument: every argument `tensortape record` shares with the Recorder,
given as a flag or as a keyword (or not given at all), makes the same run (its stored
settings, layers and steps with full tensors) or is refused by both."""
import tempfile

import pytest
import torch
import zarr
from click.testing import CliRunner
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from tensortape import cli
from tensortape.analysis import open_run
from tensortape.recorder import Recorder, RecorderError
from tensortape.recorder.format import KINDS

STEPS = 4
SCRIPT = f"""
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range({STEPS}):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
"""
DUMPING = ("dump", "raise", "replay")


def by_flags(store, script, flags):
    r = CliRunner().invoke(cli.cli, ["record", "-o", store, *flags, "--", "python", script],
                           prog_name="tensortape")
    assert r.exit_code in (0, 2), r.output
    if r.exit_code == 2:                        # one line (the console script drops click's
        assert r.stderr.strip().splitlines()[-1].startswith("Error: "), r.stderr   # usage)
    return r.exit_code == 0


def by_keywords(store, kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:     # record's own default: evaluation passes are counted, not warned about
        with Recorder(model, store, outside_step="ignore", **kwargs) as rec:
            for i in range(STEPS):
                with rec.step(i):
                    model(torch.randn(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
    except RecorderError:
        return False
    return True


def outcome(store):
    """The run as zarr's own reader sees its settings, and its layers and steps."""
    config = dict(zarr.open_group(store, mode="r").attrs["config"])
    budget = config.pop("max_bytes")
    run = open_run(store)
    steps = {k: (run.steps(k).tolist(), run.steps(k, tensors=True).tolist()) for k in run.kinds}
    return config, budget, run.layers, steps


# each shared argument: (flag, values to draw with the flag's spelling of each)
SIZES = {"auto": "auto", None: "none", 0: "0", 10**6: "1000000"}
ARGUMENTS = {
    "mode": ("--mode", st.sampled_from(["w-", "w", "a"]), str),
    "layers": ("--layers", st.sampled_from(["*", "0", "nope*"]), str),
    "capture": ("--capture", st.lists(st.sampled_from(KINDS), min_size=1, max_size=2,
                                      unique=True), None),
    "tensors_every": ("--tensors-every", st.integers(-1, 3), str),
    "stats_every": ("--stats-every", st.integers(0, 2), str),
    "ring": ("--ring", st.integers(-1, 2), str),
    "on_nonfinite": ("--on-nonfinite", st.sampled_from(["record", *DUMPING]), str),
    "max_samples": ("--max-samples", st.integers(0, 2), str),
    "max_bytes": ("--max-bytes", st.sampled_from(list(SIZES)), SIZES.get),
}


@st.composite
def arguments(draw):
    """Some of the shared arguments, each with a value valid or not."""
    names = draw(st.lists(st.sampled_from(list(ARGUMENTS)), max_size=4, unique=True))
    kwargs = {name: draw(ARGUMENTS[name][1]) for name in names}
    if kwargs.get("ring") and kwargs.get("on_nonfinite") not in DUMPING:
        kwargs["on_nonfinite"] = "dump"               # a ring is for a dump
    return kwargs


def flags_of(kwargs):
    flags = []
    for name, value in kwargs.items():
        flag, _, spell = ARGUMENTS[name]
        for v in (value if spell is None else [spell(value)]):
            flags += [flag, v]
    return flags


@settings(max_examples=12, deadline=None, derandomize=True)
@given(arguments())
@example({})                                          # the defaults
@example({"tensors_every": 0})                        # statistics only, in both
@example({"tensors_every": 2, "stats_every": 2, "max_samples": 1})
@example({"max_bytes": None, "capture": ["activations", "weights"], "layers": "0"})
@example({"ring": 2, "on_nonfinite": "dump", "max_bytes": 10**6})
def test_each_shared_argument_means_the_same_as_a_flag_and_as_a_keyword(kwargs):
    with tempfile.TemporaryDirectory() as tmp:
        script = f"{tmp}/train.py"
        with open(script, "w") as f:
            f.write(SCRIPT)
        flagged, keyed = f"{tmp}/flags.zarr", f"{tmp}/keywords.zarr"
        recorded = by_flags(flagged, script, flags_of(kwargs))
        assert by_keywords(keyed, kwargs) == recorded, kwargs
        if not recorded:
            return
        (a, budget_a, *run_a), (b, budget_b, *run_b) = outcome(flagged), outcome(keyed)
        assert a == b and run_a == run_b, kwargs
        if kwargs.get("max_bytes", "auto") == "auto":  # a share of the free space, read twice
            assert (budget_a is None) == (budget_b is None)
            assert budget_a is None or budget_a == pytest.approx(budget_b, rel=0.01)
        else:
            assert budget_a == budget_b == kwargs["max_bytes"]


def test_the_defaults_record_shows_are_the_recorders():
    """What `tensortape record --help` shows as a default is the Recorder's default (a
    flag not given passes nothing: the Recorder's own default applies)."""
    import inspect
    defaults = {name: p.default for name, p in inspect.signature(Recorder).parameters.items()}
    shown = {p.name: p.default for p in cli.record.params}
    for name in ("mode", "tensors_every", "stats_every", "ring", "on_nonfinite",
                 "max_samples", "max_bytes"):
        assert shown[name] == defaults[name], name


def test_tensors_every_0_is_statistics_only_as_a_flag_and_as_a_keyword(tmp_path):
    """0 is None: every step's statistics and no full tensor, in Python as on the command
    line (where 0 is the only way to say it)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    flagged, keyed = str(tmp_path / "flags.zarr"), str(tmp_path / "keywords.zarr")
    assert by_flags(flagged, str(script), ["--tensors-every", "0", "--stats-every", "1"])
    assert by_keywords(keyed, {"tensors_every": 0, "stats_every": 1})
    for store in (flagged, keyed):
        run = open_run(store)
        assert zarr.open_group(store, mode="r").attrs["config"]["tensors_every"] is None
        assert run.steps().tolist() == list(range(STEPS)) and run.tensor_layers() == []
