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

import os
import sys

import torch
import torch.nn.functional

from ..errors import CandidateError

_TORCH_NAMESPACES = {"torch": torch, "torch.nn.functional": torch.nn.functional, "torch.Tensor": torch.Tensor,
                     "torch.linalg": torch.linalg}


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


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def torch_own(old, new) -> bool:
    """Whether `new` is torch's own wrapper around `old` (see the module docstring)."""
    code = getattr(new, "__code__", None)
    if code is None or not os.path.abspath(code.co_filename).startswith(_TORCH_DIR):
        return False
    seen = set()
    w = getattr(new, "__wrapped__", None)
    while w is not None and id(w) not in seen:
        if w is old:
            return True
        seen.add(id(w))
        w = getattr(w, "__wrapped__", None)
    return False


def check_untouched(before: dict, who: str) -> None:
    after = fingerprint()
    changed = sorted(k for k in before if k in after and after[k] is not before[k]
                     and not torch_own(before[k], after[k]))
    removed = sorted(k for k in before if k not in after)
    if changed or removed:
        what = (changed or removed)[0]
        more = len(changed) + len(removed) - 1
        raise CandidateError(f"{who}: patches {what} at import{f' (and {more} more)' if more else ''}; "
                             "a candidate may not modify torch or the harness: refused")
