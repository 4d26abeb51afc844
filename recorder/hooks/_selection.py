"""Which modules a pattern selects, and how wrapped models are unwrapped.

Runs on the thread that attaches a Recorder or an Inspector, once, before any
hook is registered."""

from __future__ import annotations

from torch import nn

from ..patterns import match_layers

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


def select_layers(model: nn.Module, layers: str | list[str] = "*") -> list[str]:
    """Module names matched by one glob pattern or a list of them, in model order.

    Each pattern must match at least one module, or ``LayerNotFoundError``
    names it and the closest real names.
    """
    return match_layers(list(module_table(model)), layers)
