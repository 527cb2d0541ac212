"""Lockstep check: re-run the candidate on exactly the inputs the reference op saw, every k-th step of training.

Free-running A/B compares trajectories that drift apart by chaos and needs an optimizer that exposes the bug;
here the reference arm's own activations, token ids and upstream gradients are fed to the candidate, and both are
measured against the float64 oracle on those same inputs (the FlashAttention rule: a correct kernel stays within
about 2x the reference's own error, with an absolute floor near the output dtype's rounding).

Per checked step it adds to the arm's metrics: `lockstep/err_candidate`, `lockstep/err_reference` (relative L2
error against the oracle, worst output and worst call of the step), `lockstep/cos` (cosine similarity with the
oracle), and for embedding-gradient slots `lockstep/<bucket>/err_candidate|err_reference|norm_ratio` per
token-frequency bucket; for `attn_softcap`, `lockstep/max_abs_input` (error as a function of input magnitude).
"""
from __future__ import annotations

import numpy as np
import torch

from .ab.compare import bucket_rows
from .candidates import globalstate
from .slots import SLOTS, resolve
from .slots.contract import as_tuple, oracle_inputs

RATIO = 2.0  # allowed multiple of the reference's own error (FlashAttention's tests use about 2x)
WINDOW = 3  # consecutive checked steps over the limit before "wrong": one unlucky batch is not a verdict


def rounding_floor(dtype: torch.dtype) -> float:
    """Half an ulp at 1.0 of the output dtype: below this a relative error is rounding, not a bug."""
    return torch.finfo(dtype).eps / 2 if dtype.is_floating_point else 0.0


def _diff(a: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """a - o in float64 (the promotion happens in the subtraction: no separate copy); NaN counts as huge."""
    return torch.nan_to_num(torch.sub(a, o), nan=1e30)


def _rel(a: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(_diff(a, o)) / torch.linalg.vector_norm(o).clamp_min(1e-300)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """A float tensor's bits as integers (equal bits: untouched, NaN included); other tensors as they are."""
    if x.is_floating_point():
        return x.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])
    return x


def _row_sq(x: torch.Tensor) -> torch.Tensor:
    """Per-row sums of squares of a 2-D tensor, in float64 (V,)."""
    return torch.linalg.vector_norm(x, dim=1, dtype=torch.float64) ** 2


class Lockstep:
    def __init__(self, recipe, choice: dict, kernels, corpus, recorder):
        (self.slot, spec), = choice.items()
        self.contract = SLOTS[self.slot]
        self.impl = resolve(self.slot, spec)
        self.every = max(1, recipe.ab.lockstep_every)
        self.kernels, self.rec = kernels, recorder
        vocab = kernels.context.get("vocab_size")
        self.order = None  # embedding slots: every bucket's rows one after the other; `bounds`: each one's slice
        keys = ["lockstep/cos"]
        if "grad_embed_weight" in self.contract.outputs:
            rows = bucket_rows(corpus.rank, vocab)
            self.order = torch.as_tensor(np.concatenate(list(rows.values())), dtype=torch.long)
            ends = np.cumsum([len(r) for r in rows.values()]).tolist()
            self.bounds = tuple(zip([0] + ends[:-1], ends))
            keys += [f"lockstep/{b}/{m}" for b in rows for m in ("err_candidate", "err_reference", "norm_ratio")]
        keys += ["lockstep/err_candidate", "lockstep/err_reference", "lockstep/floor"]
        if self.slot == "attn_softcap":
            keys.append("lockstep/max_abs_input")
        self.keys = keys  # the order of each step's packed float64 vector
        self.is_err = torch.tensor(["err" in k for k in keys])
        self.rows = {}  # step -> packed (len(keys),) float64 tensor on the device
        self.history = []  # (step, wrong: bool, err_c, err_r) after each flush
        self.mutation = None  # device flags, one per tensor input: did the candidate write into it (no sync per step)
        self.tensor_names = None  # those inputs' names, from the first check (scalars such as eps have no flag)
        self.error = None  # the candidate raised on live inputs: recorded once, checking stops
        self.global_state = None  # what the candidate changed of torch's global state (first time), put back
        # The error metrics are the harness's own code: under `train.compile` they run as one compiled graph (about
        # 100 small kernels a check otherwise). The candidate and the oracle run as written (compiling the embedding
        # oracle with them failed to build in Triton 3.6 on the H200, 2026-11-21).
        self.measure, self.compiled = self._measure, False
        self.compile_fallback = None  # why the compiled metrics were given up for eager ones, if they were
        if recipe.train.compile:
            from .model.transformer import compile_options

            # No CUDA graphs: the check runs on autograd's thread, beside the step's graphs.
            opts = compile_options(recipe.train.compile, cudagraphs=False)
            self.measure, self.compiled = torch.compile(self._measure, dynamic=False, **opts), True
        kernels.add_tap(self.tap, [self.slot])
        recorder.lockstep = self

    def tap(self, slot, inputs, ref_out):
        step = self.rec.current_step
        if self.error or step % self.every or (self.contract.kind == "forward" and not torch.is_grad_enabled()):
            return  # evaluation passes run under no_grad: only training steps are checked
        try:
            with torch.no_grad():
                row = self._check(inputs, as_tuple(ref_out))
        except Exception as e:  # the candidate's exception must not end the reference arm
            self.error = f"step {step}: {type(e).__name__}: {e}".splitlines()[0][:300]
            return
        prev = self.rows.get(step)
        # Several calls per step (e.g. one rmsnorm per layer): keep the worst of each error, the last of the rest.
        if prev is not None:
            if self.is_err.device != row.device:  # once: no host-to-device copy per call
                self.is_err = self.is_err.to(row.device)
            row = torch.where(self.is_err, torch.maximum(row, prev), row)
        self.rows[step] = row

    def _check(self, inputs, ref_out) -> torch.Tensor:
        ctx = {k: self.kernels.context[k] for k in self.contract.context}
        fresh = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
        state = globalstate.snapshot()  # the candidate must not change this arm's own training (globalstate.py)
        try:
            cand = as_tuple(self.impl.fn(*fresh, **ctx))
        finally:
            what = globalstate.changed(state, globalstate.snapshot())
            if what:
                globalstate.restore(state)
                self.global_state = self.global_state or globalstate.describe(what)
        # Did the candidate write into an input? Bitwise comparison with the untouched original (NaN-safe in one
        # kernel per input); device flags, read once at the end.
        if self.tensor_names is None:
            self.tensor_names = [n for n, x in zip(self.contract.inputs, inputs) if isinstance(x, torch.Tensor)]
        changed = torch.stack([_bits(a).ne(_bits(b)).any() for a, b in zip(fresh, inputs)
                               if isinstance(a, torch.Tensor)])
        self.mutation = changed if self.mutation is None else self.mutation | changed
        floor = max(rounding_floor(o.dtype) for o in ref_out if isinstance(o, torch.Tensor))
        if self.order is not None and self.order.device != cand[0].device:  # once: no copy to the device per step
            self.order = self.order.to(cand[0].device)
        orc = as_tuple(self.contract.oracle(*oracle_inputs(self.contract, inputs), **ctx))
        args = (tuple(inputs), cand, tuple(ref_out), orc, floor, self.order)
        try:
            return self.measure(*args)
        except Exception as e:
            if not self.compiled:
                raise
            row = self._measure(*args)  # raises again where the candidate's outputs are at fault, not the compiler
            # Our compiled code failed where eager metrics work: check on, eagerly, and say so.
            self.compile_fallback = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            self.measure, self.compiled = self._measure, False
            return row

    def _measure(self, inputs, cand, ref_out, orc, floor: float, order):
        """Every metric of `self.keys` against the oracle's outputs `orc`, packed into one float64 vector."""
        tiny = 1e-300
        if order is not None:
            c, r, o = cand[0], ref_out[0], orc[0]
            cf = torch.nan_to_num(c.to(torch.float64))
            # Per-row sums of squares (V, 4), then each bucket's sums over its slice of the rows in bucket order.
            stats = torch.stack([_row_sq(_diff(c, o)), _row_sq(_diff(r, o)), _row_sq(o), _row_sq(cf)], 1)
            ranked = stats[order]
            sums = torch.stack([ranked[a:b].sum(0) for a, b in self.bounds])  # (buckets, 4)
            total = stats.sum(0)
            oo = total[2].clamp_min(tiny)
            cos = (cf * o).sum() / (total[3] * total[2]).sqrt().clamp_min(tiny)
            first_c, first_r = (total[0] / oo).sqrt(), (total[1] / oo).sqrt()
            ob = sums[:, 2].clamp_min(tiny)
            per_bucket = torch.stack([(sums[:, 0] / ob).sqrt(), (sums[:, 1] / ob).sqrt(),
                                      (sums[:, 3] / ob).sqrt()], 1).flatten()  # bucket-major, as in keys
            head = [cos.reshape(1), per_bucket]
        else:
            c0, o0 = cand[0].to(torch.float64).flatten(), orc[0].flatten()
            cos = torch.nn.functional.cosine_similarity(torch.nan_to_num(c0), o0, dim=0)
            first_c, first_r = _rel(cand[0], orc[0]), _rel(ref_out[0], orc[0])
            head = [cos.reshape(1)]
        err_c = torch.stack([first_c] + [_rel(c, o) for c, o in zip(cand[1:], orc[1:])]).max()
        err_r = torch.stack([first_r] + [_rel(r, o) for r, o in zip(ref_out[1:], orc[1:])]).max()
        tail = [err_c.reshape(1), err_r.reshape(1), torch.full((1,), floor, dtype=torch.float64, device=err_c.device)]
        if self.slot == "attn_softcap":
            x = inputs[0]
            tail.append(x.masked_fill(torch.isinf(x), 0).abs().max().to(torch.float64).reshape(1))
        return torch.cat(head + tail)

    def collect_steps(self, steps) -> dict:
        """Called by the recorder at flush time: step -> that step's lockstep metrics as floats (one copy for all
        the steps of the flush), with the rule applied."""
        have = [s for s in steps if s in self.rows]
        if not have:
            return {}
        packed = torch.stack([self.rows.pop(s) for s in have]).cpu().tolist()
        out = {}
        for step, vals in zip(have, packed):
            vals = dict(zip(self.keys, vals))
            wrong = self._wrong(vals)
            vals["lockstep/wrong"] = float(wrong)
            self.history.append((step, wrong, vals["lockstep/err_candidate"], vals["lockstep/err_reference"]))
            out[step] = vals
        return out

    @staticmethod
    def _wrong(v: dict) -> bool:
        floor = v["lockstep/floor"]
        pairs = [("lockstep/err_candidate", "lockstep/err_reference")]
        pairs += [(k, k.replace("err_candidate", "err_reference")) for k in v
                  if k.endswith("/err_candidate") and k != "lockstep/err_candidate"]
        return any(not (v[c] <= RATIO * v[r] + floor) for c, r in pairs)  # NaN counts as wrong

    def _mutated_input(self):
        if self.mutation is None:
            return None
        return next((n for n, f in zip(self.tensor_names, self.mutation.cpu().tolist()) if f), None)

    def summary(self) -> dict:
        run, first = 0, None
        for step, wrong, *_ in self.history:
            run = run + 1 if wrong else 0
            if run >= WINDOW and first is None:
                first = step - (WINDOW - 1) * self.every
        worst = max(self.history, key=lambda h: h[2] / max(h[3], 1e-30), default=None)
        return {
            "slot": self.slot, "candidate": self.impl.name, "checked_steps": len(self.history),
            "every": self.every, "wrong": first is not None, "first_wrong_step": first,
            "wrong_steps": sum(1 for h in self.history if h[1]),
            "worst_step": worst[0] if worst else None,
            "worst_err_candidate": worst[2] if worst else None,
            "worst_err_reference": worst[3] if worst else None,
            "mutated_input": self._mutated_input(),
            "global_state": self.global_state,
            "compiled_metrics": self.compiled,
            "compile_fallback": self.compile_fallback,
            "error": self.error,
            "rule": f"err_candidate <= {RATIO} x err_reference + rounding floor, overall and per frequency "
                    f"bucket; wrong after {WINDOW} consecutive checked steps over it",
        }
