"""Opening a run for a Recorder, on every rank (``Recorder.attach``).

Rank 0 applies the mode to the run as a whole: it claims the run first
(``_claim``), then writes a new root whole.  Every rank waits for it (a
barrier under torch.distributed), so none opens a root not yet written, and
an error of rank 0's is raised on every rank after the barrier, so no rank
hangs.  Then each rank opens its own part (``RunStore``) and its state (a new
one, or the stored one under ``mode="a"``); rank 0 commits the run's
attributes.

Training thread, once per Recorder.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

import torch

from . import format as fmt
from ._claim import Claim
from ._config import RecorderConfig
from ._quiet import quiet
from ._root import open_root
from ._store import RunStore

__all__ = ["Opened", "all_ranks_then", "open_run", "rank_and_world"]


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world's size (0 and 1 outside torch.distributed)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_ranks_then(world: int, error: BaseException | None) -> None:
    """Wait for every rank (under torch.distributed), then raise ``error`` if any."""
    if world > 1:
        torch.distributed.barrier()
    if error is not None:
        raise error


@dataclass
class Opened:
    """A rank's part of a run, opened: what its writer is made of."""
    store: RunStore
    state: fmt.RankState
    root_base: dict | None              # the run's attributes (rank 0's; None on the others)
    claim: Claim | None                 # rank 0's; the writer releases it

    def abandon(self) -> None:
        """What opened it is given back (a failure before the writer took it)."""
        self.store.close(wait=False)
        if self.claim is not None:
            self.claim.release()


def open_run(location: str, cfg: RecorderConfig, rank: int, world: int, model_class: str,
             metadata: dict) -> Opened:
    """Open (or create, by ``cfg.mode``) the run at ``location`` for this rank (see
    the module); every rank calls it."""
    root, claim, error = None, None, None
    fresh = dict(tensortape_format=fmt.FORMAT_VERSION, status=fmt.STATUS_RECORDING,
                 torch_version=torch.__version__, model_class=model_class,
                 config=cfg.to_json(), metadata=metadata,
                 created=datetime.now(timezone.utc).isoformat())
    if rank == 0:                             # applies the mode to the run as a whole
        try:                                  # claimed first; a new root written whole
            with quiet():
                claim = Claim.acquire(location, cfg.mode, 0, world)
                root = open_root(location, cfg.mode, claim=claim,
                                 attributes=fmt.to_json(fmt.root_attrs(fmt.RankState(), fresh)))
        except Exception as e:
            error = e
            if claim is not None:
                claim.release()
    all_ranks_then(world, error)
    if root is None:
        with quiet():
            root = open_root(location, cfg.mode, rank)
    store = None
    try:                                      # a failure here gives the claim back
        store = RunStore(root, rank, cfg.compression)
        state = store.state() if cfg.mode == "a" else fmt.RankState(rank=rank, nonfinite={})
        state.rank = rank
        root_base = None
        if rank == 0:
            old = dict(root.attrs) if cfg.mode == "a" else {}
            root_base = {**old, **fresh, "created": old.get("created", fresh["created"]),
                         "metadata": metadata or old.get("metadata", {})}
            store.commit(state, fmt.root_attrs(state, root_base))
    except BaseException:
        if store is not None:
            store.close(wait=False)
        if claim is not None:
            claim.release()
        raise
    return Opened(store, state, root_base, claim)
