"""Dynamo's process-wide setting: hook guards on while a recorder is attached, and
the user's own setting back after the last one closes."""
import gc

import pytest
import torch
import torch._dynamo

from tensortape.analysis import Inspector
from tensortape.recorder import Recorder
from conftest import InplaceMLP


def _skips() -> bool:
    return torch._dynamo.config.skip_nnmodule_hook_guards


@pytest.fixture(params=[True, False], ids=["dynamo-default", "user-set-False"])
def user_setting(request):
    """The user's own value of the setting, whatever tests before left attached."""
    gc.collect()                       # recorders of earlier tests, forgotten: detached
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=request.param):
        yield request.param


def test_kept_while_one_recorder_is_attached_and_restored_after_the_last(tmp_path,
                                                                          user_setting):
    a = Recorder(InplaceMLP(0), str(tmp_path / "a.zarr"), layers="fc*", tensors_every=1, stats_every=1).attach()
    assert _skips() is False
    b = Recorder(InplaceMLP(1), str(tmp_path / "b.zarr"), layers="fc1", tensors_every=1, stats_every=1).attach()
    a.close()
    assert _skips() is False                    # b is still attached
    a.close()                                   # a second close changes nothing
    assert _skips() is False
    b.close()
    assert _skips() is user_setting


def test_restored_after_a_forgotten_recorder_and_an_inspection(tmp_path, user_setting):
    rec = Recorder(InplaceMLP(0), str(tmp_path / "a.zarr"), layers="fc*", tensors_every=1, stats_every=1).attach()
    inspector = Inspector(InplaceMLP(1))
    inspector.watch("fc1")
    inspector.run_inspection(torch.randn(4, 8))         # attaches and detaches inside
    assert _skips() is False                            # rec is still attached
    del rec
    gc.collect()                                        # its finaliser detaches it
    assert _skips() is user_setting
    inspector.run_inspection(torch.randn(4, 8))
    assert _skips() is user_setting
