"""Refuse candidates that patch torch or the harness at import.

A candidate that replaces `torch.nn.functional.softmax`, a `torch.Tensor` method or one of our own functions could
make the reference agree with it. The namespaces are fingerprinted (name -> id of the object) before the candidate
is imported and compared after; any replaced or removed callable refuses the candidate. Added names are not
compared: a candidate that imports a harness module (or a lazily loaded torch one) adds names harmlessly.
"""
from __future__ import annotations

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
    out = {}
    for space, obj in _namespaces().items():
        for k, v in list(vars(obj).items()):
            if callable(v) or isinstance(v, (staticmethod, classmethod, property)):
                out[f"{space}.{k}"] = id(v)
    return out


def check_untouched(before: dict, who: str) -> None:
    after = fingerprint()
    changed = sorted(k for k in before if k in after and after[k] != before[k])
    removed = sorted(k for k in before if k not in after)
    if changed or removed:
        what = (changed or removed)[0]
        more = len(changed) + len(removed) - 1
        raise CandidateError(f"{who}: patches {what} at import{f' (and {more} more)' if more else ''}; "
                             "a candidate may not modify torch or the harness: refused")
