"""The replay bundle: a kept call as arrays and JSON (no pickle), and back.

Under ``on_nonfinite="replay"`` the producer call of the run's first NaN/Inf
is stored with its step (``format.replay_group``), so ``run.replay(model)``
and ``tensortape replay`` can run it again offline (``replay.replay_bundle``).
``bundle`` on the training thread (at the step's end), ``from_bundle`` on the
reader's.
"""

from __future__ import annotations

import torch

from ..hooks._callnames import split_call
from ._keeper import Call, floating, tensors

__all__ = ["bundle", "from_bundle"]


def bundle(call: Call) -> tuple[dict, dict[str, torch.Tensor]]:
    """The call as JSON attributes and host tensors: its inputs' structure (each
    tensor a ``{"tensor": i}`` placeholder), parameters, buffers, output gradients,
    RNG and autocast state, grad mode, module path and class, torch version."""
    arrays: dict[str, torch.Tensor] = {}

    def put(x):
        if isinstance(x, torch.Tensor):
            i = len([k for k in arrays if k.startswith("input_")])
            arrays[f"input_{i}"] = x.detach().to("cpu", copy=True)
            return {"tensor": i, "requires_grad": bool(x.requires_grad)}
        if isinstance(x, (list, tuple)):
            return {"list" if isinstance(x, list) else "tuple": [put(v) for v in x]}
        if isinstance(x, dict):
            return {"dict": {str(k): put(v) for k, v in x.items()}}
        if x is None or isinstance(x, (bool, int, float, str)):
            return {"value": x}
        return {"value": None, "dropped": type(x).__qualname__}
    structure = {"args": put(list(call.args)), "kwargs": put(dict(call.kwargs))}
    for name, p in call.module.named_parameters():
        arrays[f"param_{name}"] = p.detach().to("cpu", copy=True)
    for name, b in call.module.named_buffers():
        arrays[f"buffer_{name}"] = b.detach().to("cpu", copy=True)
    for path, g in (call.grads or {}).items():
        arrays[f"grad_{path}"] = g.detach().to("cpu", copy=True)
    arrays["rng_cpu"] = call.rng.clone()
    for d, state in call.cuda_rng.items():
        arrays[f"rng_cuda{torch.device(d).index or 0}"] = state.clone()
    attrs = {"module": call.name, "module_path": call.path, "module_class": type(call.module).__qualname__,
             "micro": call.micro, "grad": call.grad, "structure": structure,
             "autocast": {d: [bool(on), str(dt).removeprefix("torch.")]
                          for d, (on, dt) in call.autocast.items()},
             "grads": sorted((call.grads or {})), "torch_version": torch.__version__,
             "caller": list(call.caller) if call.caller else None}
    return attrs, arrays


def from_bundle(attrs: dict, arrays, model: torch.nn.Module) -> Call:
    """The call of a bundle, in ``model``: its submodule at the bundle's path gets
    the recorded parameters and buffers; the inputs come on that module's device.
    ``arrays(name)`` gives a stored tensor (on the CPU)."""
    path = attrs.get("module_path")             # None: a bundle written before it was stored
    if path is None:
        path = split_call(attrs["module"])[0]
    module = model.get_submodule(path)
    device = next(iter(module.parameters()), torch.zeros(0)).device
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(arrays(f"param_{name}"))
        for name, b in module.named_buffers():
            b.copy_(arrays(f"buffer_{name}"))

    def get(node):
        if "tensor" in node:
            t = arrays(f"input_{node['tensor']}").to(device)
            return t.requires_grad_(node.get("requires_grad", False) and floating(t))
        if "list" in node:
            return [get(v) for v in node["list"]]
        if "tuple" in node:
            return tuple(get(v) for v in node["tuple"])
        if "dict" in node:
            return {k: get(v) for k, v in node["dict"].items()}
        return node.get("value")
    args, kwargs = tuple(get(attrs["structure"]["args"])), get(attrs["structure"]["kwargs"])
    grads = {p: arrays(f"grad_{p}").to(device) for p in attrs.get("grads", [])}
    return Call(attrs["module"], attrs.get("micro", 0), module, args, kwargs,
                [t._version for t in tensors((args, kwargs))], None, arrays("rng_cpu"), {},
                {d: (on, getattr(torch, dt)) for d, (on, dt) in attrs["autocast"].items()},
                attrs.get("grad", True), grads=grads or None,
                caller=tuple(attrs["caller"]) if attrs.get("caller") else None, path=path)
