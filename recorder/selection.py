"""Which modules a pattern selects, and how wrapped models are unwrapped."""

from __future__ import annotations

import difflib
import fnmatch

from torch import nn

from .errors import LayerNotFoundError

__all__ = ["unwrap", "module_table", "select_layers"]

# Wrapper modules whose child holds the real model, by attribute name.
_WRAPPER_ATTRS = ("_orig_mod", "module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
# Name segments that wrappers insert inside the model ("module" is left alone: users use it too).
_WRAPPER_SEGMENTS = {"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}
_WRAPPER_CLASSES = ("OptimizedModule", "DistributedDataParallel", "DataParallel",
                    "FullyShardedDataParallel", "CheckpointWrapper", "OffloadWrapper")


def _is_wrapper(m: nn.Module) -> bool:
    return type(m).__name__ in _WRAPPER_CLASSES


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside ``torch.compile``, DDP or FSDP wrappers."""
    while _is_wrapper(model):
        model = next(getattr(model, a) for a in _WRAPPER_ATTRS if isinstance(getattr(model, a, None), nn.Module))
    return model


def module_table(model: nn.Module) -> dict[str, nn.Module]:
    """``named_modules()`` of the unwrapped model, with wrapper segments removed."""
    table: dict[str, nn.Module] = {}
    for name, m in unwrap(model).named_modules():
        if _is_wrapper(m):
            continue
        parts = [p for p in name.split(".") if p and p not in _WRAPPER_SEGMENTS]
        table[".".join(parts)] = m
    return table


def _closest(pattern: str, names: list[str]) -> str:
    shown = [n if n else '"" (the root)' for n in difflib.get_close_matches(pattern, names, n=3, cutoff=0.3)]
    if not shown:
        shown = [n for n in names if n][:3]
    return ", ".join(shown)


def select_layers(model: nn.Module, layers: str | list[str] = "*") -> list[str]:
    """Module names matched by one glob pattern or a list of them, in model order.

    Each pattern must match at least one module, or ``LayerNotFoundError``
    names it and the closest real names.
    """
    patterns = [layers] if isinstance(layers, str) else list(layers)
    names = list(module_table(model))
    chosen: set[str] = set()
    for p in patterns:
        if not isinstance(p, str):
            raise LayerNotFoundError(f"layer pattern {p!r} is not a string; pass glob patterns like 'encoder.*'")
        hits = [n for n in names if fnmatch.fnmatchcase(n, p)]
        if not hits:
            raise LayerNotFoundError(
                f"layer pattern {p!r} matches no module; closest names: {_closest(p, names)}")
        chosen.update(hits)
    return [n for n in names if n in chosen]
