"""Harness code that runs compiled under `train.compile`: the step's metrics and the Adafactor update.

Compiled with the model body's backend but without CUDA graphs: these functions write into their inputs (the
parameters, the metrics' copy of them). Should compiling fail (a compiler bug on some card or version), the function
is given up for its eager self, once, and the reason goes into arm.json (`compile_fallback`): the arm trains on.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch


class MaybeCompiled:
    """`fn`, compiled under `spec` (a `train.compile` value; None: eager)."""

    def __init__(self, fn: Callable, spec: Optional[str]):
        self.fn, self.run, self.fallback = fn, fn, None
        if spec:
            from ..model.transformer import compile_options

            self.run = torch.compile(fn, dynamic=False, **compile_options(spec, cudagraphs=False))

    @property
    def compiled(self) -> bool:
        return self.run is not self.fn

    def __call__(self, *args, **kwargs):
        if not self.compiled:
            return self.fn(*args, **kwargs)
        try:
            return self.run(*args, **kwargs)
        except Exception as e:  # the compiler's failure, not the arm's: the eager function computes the same
            self.fallback = f"{self.fn.__name__}: {type(e).__name__}: {e}".splitlines()[0][:300]
            self.run = self.fn
            return self.fn(*args, **kwargs)
