"""Refuse candidates that patch torch or the harness at import.

A candidate that replaces `torch.nn.functional.softmax`, a `torch.Tensor` method or one of our own functions could
make the reference agree with it. The namespaces are fingerprinted (name -> id of the object) before the candidate
is imported and compared after; any replaced or removed callable refuses the candidate. Added names are not
compared: a candidate that imports a harness module (or a lazily loaded torch one) adds names harmlessly.

torch changes its own namespace when a subsystem is first imported: importing torch._dynamo (which a module-level
`torch.compile` does) replaces `torch.manual_seed` with a wrapper that disables dynamo around it. That is torch's
doing, not the candidate's: a replacement counts as torch's own when its code lives in torch's package and it wraps
(`__wrapped__`, followed through) the very object it replaced. A candidate's own wrapper lives in the candidate's
file and is refused, whatever it wraps.
"""
from __future__ import annotations

import sys

import torch.nn.functional  # noqa: F401 (the namespaces below are torch's, loaded)

from ..errors import CandidateError
from ..sandbox.kernel_server import TORCH_NAMESPACES, namespace, torch_own  # the kernel server guards the same

_TORCH_NAMESPACES = {n: namespace(n) for n in TORCH_NAMESPACES}


def _namespaces() -> dict:
    spaces = dict(_TORCH_NAMESPACES)
    for name, mod in list(sys.modules.items()):
        if name == "divergence" or (name.startswith("divergence.") and not name.startswith("divergence.zoo.")):
            spaces[name] = mod
    return spaces


def fingerprint() -> dict:
    """{qualified name: the object} of every callable in the guarded namespaces (objects, not ids: an id can be
    reused once its object is gone, and torch's own wrappers are told apart by what they wrap)."""
    out = {}
    for space, obj in _namespaces().items():
        for k, v in list(vars(obj).items()):
            if callable(v) or isinstance(v, (staticmethod, classmethod, property)):
                out[f"{space}.{k}"] = v
    return out


def check_untouched(before: dict, who: str) -> None:
    after = fingerprint()
    changed = sorted(k for k in before if k in after and after[k] is not before[k]
                     and not torch_own(before[k], after[k]))
    removed = sorted(k for k in before if k not in after)
    if changed or removed:
        refuse(who, changed, removed)


def refuse(who: str, changed: list, removed: list) -> None:
    """The refusal of a candidate that replaced (`changed`) or removed callables of torch or the harness at import,
    in this process or in its kernel server."""
    what = (changed or removed)[0]
    more = len(changed) + len(removed) - 1
    raise CandidateError(f"{who}: patches {what} at import{f' (and {more} more)' if more else ''}; "
                         "a candidate may not modify torch or the harness: refused")
