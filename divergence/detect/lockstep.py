"""Lockstep check: in the candidate's own arm, every k-th step, the reference op and the float64 oracle run on
exactly the inputs the candidate was given (its activations, token ids and upstream gradients, taken before it
ran), so that both errors are measured on identical inputs.

Free-running A/B compares trajectories that drift apart by chaos and needs an optimizer that exposes the bug;
here the candidate's output that drives training and the reference op's output on the same inputs are both
measured against the oracle (the FlashAttention rule: a correct kernel stays within about 2x the reference's own
error, with an absolute floor near the output dtype's rounding). The reference and null arms run no candidate code
at all, so they can be shared by every candidate of a soak and cached (ab/share.py).

Each checked call's outputs are also kept, with a copy taken then: the slot's next call, on other inputs, must
leave them as they were (slots/outputs.py: a buffer the next call overwrites, as a replayed CUDA graph's, ends the
arm with an OutputError in those words; Kernels refuses outputs that are more than plain tensors before any tap).

Per checked step it adds to the arm's metrics: `lockstep/err_candidate`, `lockstep/err_reference` (relative L2
error against the oracle, worst output; both of the same call, the step's worst call by the rule), `lockstep/cos`
(cosine similarity with the oracle), `lockstep/score` (that call's rule.score, err_candidate / (RATIO x
err_reference + floor): above 1 breaks the rule), `lockstep/ratio` (err_candidate / err_reference, geometric mean
over the step's calls: what the whole-record rule reads), `lockstep/calls`, and for embedding-gradient slots
`lockstep/<bucket>/err_candidate|err_reference|norm_ratio` per token-frequency bucket; for `attn_softcap`,
`lockstep/max_abs_input` (error as a function of input magnitude).

Judgement (rule.py): per call, each call's candidate error against that same call's reference error (one rmsnorm
per layer: never the worst candidate call against the worst reference call of another layer); over the record,
rule.record_judgement (one step far over its limit, a count of steps over it among the last few, or the median
per-step ratio).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..candidates import globalstate
from ..slots import SLOTS, bitwise
from ..errors import OutputError, one_line
from ..slots.contract import as_tuple, copies, oracle_inputs
from ..slots.outputs import OVERWRITTEN, Flags, Kept, is_overwritten_error
from .. import rule
from .buckets import bucket_rows
from ..rule import RATIO, diff64 as _diff, record_judgement, record_ratio, rel_error as _rel, rounding_floor


def _row_sq(x: torch.Tensor) -> torch.Tensor:
    """Per-row sums of squares of a 2-D tensor, in float64 (V,)."""
    return torch.linalg.vector_norm(x, dim=1, dtype=torch.float64) ** 2


class Lockstep:
    def __init__(self, recipe, slot: str, kernels, corpus, recorder):
        """Checks whatever implementation fills `slot` in `kernels` (the candidate, in the candidate arm)."""
        self.slot, self.contract = slot, SLOTS[slot]
        self.impl = kernels.impls[slot]
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
        keys += ["lockstep/err_candidate", "lockstep/err_reference", "lockstep/floor", "lockstep/score",
                 "lockstep/ratio", "lockstep/calls"]
        if self.slot == "attn_softcap":
            keys.append("lockstep/max_abs_input")
        self.keys = keys  # the order of each step's packed float64 vector
        # Summed over a step's calls (the geometric-mean ratio's log and the count); the rest come from its worst call.
        self.is_sum = torch.tensor([k in ("lockstep/ratio", "lockstep/calls") for k in keys])
        self.i_score = keys.index("lockstep/score")
        self.rows = {}  # step -> packed (len(keys),) float64 tensor on the device
        self.history = []  # (step, wrong: bool, err_c, err_r, ratio, score) after each flush
        self.mutation = None  # device flags, one per tensor input: did the candidate write into it (no sync per step)
        self.tensor_names = None  # those inputs' names, from the first check (scalars such as eps have no flag)
        self.error = None  # the check itself failed (the reference op or the oracle raised): recorded once, stops
        self.given = None  # (step, copies of the inputs as the candidate got them), taken by `before`
        self.state = None  # torch's global state before the candidate's call, taken by `before`
        self.global_state = None  # what the candidate changed of it (the first time), put back after the call
        # The last checked call's outputs with copies taken then (slots/outputs.py: Kept), and its step: the slot's
        # next call, on other inputs, must leave them as they were; its device flags are read without a sync.
        self.kept, self.overwrites = None, Flags()
        # The error metrics are the harness's own code: under `train.compile` they run as one compiled graph (about
        # 100 small kernels a check otherwise). The candidate and the oracle run as written (compiling the embedding
        # oracle with them failed to build in Triton 3.6 on the H200, 2026-11-21).
        self.measure, self.compiled = self._measure, False
        self.compile_fallback = None  # why the compiled metrics were given up for eager ones, if they were
        if recipe.train.compile:
            from ..model.transformer import compile_options

            # No CUDA graphs: the check runs on autograd's thread, beside the step's graphs.
            opts = compile_options(recipe.train.compile, cudagraphs=False)
            self.measure, self.compiled = torch.compile(self._measure, dynamic=False, **opts), True
        # On a GPU arm whose recipe replays CUDA graphs, the check's body (the reference op, the float64 oracle and
        # the metrics) replays as one graph per input signature (CheckGraphs): eager it is about 120 launches a
        # check, and the candidate's arm is host-bound.
        self.graphs = CheckGraphs() if _graphs_wanted(recipe) else None
        kernels.add_tap(self.tap, [self.slot], before=self.before)
        recorder.lockstep = self

    def _due(self) -> bool:
        # Evaluation passes (the recorder's `evaluating`) are not training steps: only those are checked.
        return not (self.error or self.rec.current_step % self.every or getattr(self.rec, "evaluating", False))

    def before(self, slot, inputs):
        """Before the candidate runs: a copy of its inputs, should it write into them (the copy is what the
        reference op and the oracle get, and what a write is detected against)."""
        if self._due():
            # torch's global state too (seed, default dtype, deterministic and TF32 flags, matmul precision): a
            # candidate that changes it at call time changes its own arm's training, not just its output; the tap
            # names it and puts it back (candidates/globalstate.py: 12.5 us a snapshot and comparison, CPU).
            self.state = globalstate.snapshot()
            with torch.no_grad():
                self.given = (self.rec.current_step, list(copies(inputs)))

    def tap(self, slot, inputs, cand_out):
        step = self.rec.current_step
        self._overwritten()
        given, self.given = self.given, None
        state, self.state = self.state, None
        if state is not None:
            what = globalstate.put_back(state)
            if what:
                self.global_state = self.global_state or what
        if given is None or given[0] != step:  # `before` set it only on a due step
            return
        try:
            with torch.no_grad():
                row = self._check(given[1], as_tuple(cand_out), live=inputs)
        except Exception as e:  # our own check failing must not end the candidate's arm: say so, check no more
            self.error = f"step {step}: {one_line(e)}"
            return
        with torch.no_grad():
            self.kept = (step, Kept(self.contract, as_tuple(cand_out), inputs))
        prev = self.rows.get(step)
        # Several calls per step (e.g. one rmsnorm per layer): each call was judged against its own reference
        # error (its score); the step keeps the whole row of the worst-scoring call, and sums the log-ratios.
        if prev is not None:
            if self.is_sum.device != row.device:  # once: no host-to-device copy per call
                self.is_sum = self.is_sum.to(row.device)
            worse = row[self.i_score] > prev[self.i_score]
            row = torch.where(self.is_sum, row + prev, torch.where(worse, row, prev))
        self.rows[step] = row

    def _overwritten(self):
        """After each call of the slot: did it change the last checked call's outputs? An OutputError ends the arm:
        what was checked is not what a caller that keeps an output reads (a CUDA graph's buffer, replayed)."""
        kept, self.kept = self.kept, None
        said = None
        if kept is not None:
            try:
                with torch.no_grad():
                    self.overwrites.add(kept[1].changed(), kept[0])
            except RuntimeError as e:  # torch's own words for reading a CUDA-graph output a replay rewrote
                if not is_overwritten_error(e):
                    raise
                said = kept[0]
        said = self.overwrites.first() if said is None else said
        if said is not None:
            raise OutputError(f"{self.slot}: {self.impl.role} {self.impl.name}: {OVERWRITTEN} (an output of step "
                              f"{said} changed at the slot's next call, on live inputs)")

    def _check(self, inputs, cand, live) -> torch.Tensor:
        """One call's metrics: `inputs` as the candidate got them, `cand` its outputs, `live` its input tensors
        after it ran."""
        if self.tensor_names is None:
            self.tensor_names = [n for n, x in zip(self.contract.inputs, inputs) if isinstance(x, torch.Tensor)]
        dev = next(x.device for x in cand if isinstance(x, torch.Tensor))
        if self.order is not None and self.order.device != dev:  # once: no copy to the device per step
            self.order = self.order.to(dev)
        # Did the candidate write into an input? Bit for bit against the copy taken before it ran (bitwise.py: the
        # probe's rule too); device flags, read once at the end.
        changed = torch.stack([bitwise.changed(a, b) for a, b in zip(live, inputs) if isinstance(a, torch.Tensor)])
        self.mutation = changed if self.mutation is None else self.mutation | changed
        if self.graphs is not None and self.graphs.fits(dev, inputs, cand):
            return self.graphs(self._body, inputs, cand)
        return self._body(inputs, cand)

    def _body(self, inputs, cand) -> torch.Tensor:
        """The packed metrics of one call: what a check graph captures (the harness's code alone)."""
        ctx = {k: self.kernels.context[k] for k in self.contract.context}
        ref_out = as_tuple(self.contract.reference(*inputs, **ctx))
        floor = max(rounding_floor(o.dtype) for o in ref_out if isinstance(o, torch.Tensor))
        orc = as_tuple(self.contract.oracle(*oracle_inputs(self.contract, inputs), **ctx))
        args = (tuple(inputs), tuple(cand), tuple(ref_out), orc, floor, self.order)
        try:
            return self.measure(*args)
        except Exception as e:
            if not self.compiled or (getattr(cand[0], "is_cuda", False) and torch.cuda.is_current_stream_capturing()):
                raise  # uncompiled, or a check graph's capture that failed: its graph is given up, not the compiler
            row = self._measure(*args)  # raises again where the candidate's outputs are at fault, not the compiler
            # Our compiled code failed where eager metrics work: check on, eagerly, and say so.
            self.compile_fallback = one_line(e)
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
        errs_c = torch.stack([first_c] + [_rel(c, o) for c, o in zip(cand[1:], orc[1:])])
        errs_r = torch.stack([first_r] + [_rel(r, o) for r, o in zip(ref_out[1:], orc[1:])])
        # The rule per output (and per bucket), each candidate error against the reference's on the same output.
        pairs_c, pairs_r = errs_c, errs_r
        if order is not None:
            pb = per_bucket.view(-1, 3)
            pairs_c, pairs_r = torch.cat([errs_c, pb[:, 0]]), torch.cat([errs_r, pb[:, 1]])
        score = rule.score(pairs_c, pairs_r, floor).max()
        err_c, err_r = errs_c.max(), errs_r.max()
        log_ratio = torch.log(record_ratio(err_c, err_r, floor))  # 0 / 0 (both exact) reads as 1
        dev = errs_c.device
        tail = [err_c.reshape(1), err_r.reshape(1),
                torch.full((1,), floor, dtype=torch.float64, device=dev), score.reshape(1), log_ratio.reshape(1),
                torch.ones(1, dtype=torch.float64, device=dev)]
        if self.slot == "attn_softcap":
            x = inputs[0]
            tail.append(x.masked_fill(torch.isinf(x), 0).abs().max().to(torch.float64).reshape(1))
        return torch.cat(head + tail)

    def stage(self, steps) -> tuple:
        """Called by the recorder at flush time: (the steps of `steps` that were checked, their packed rows as one
        device tensor (len, len(keys)) or None), taken out of `rows`; the recorder copies them to the host with the
        rest of the flush and hands the values to `judge`."""
        have = [s for s in steps if s in self.rows]
        return have, (torch.stack([self.rows.pop(s) for s in have]) if have else None)

    def judge(self, have, values) -> dict:
        """step -> that step's lockstep metrics as floats, with the rule applied; `values`: the rows `stage` gave
        for `have`, flat, as floats."""
        out, k = {}, len(self.keys)
        for i, step in enumerate(have):
            vals = dict(zip(self.keys, values[i * k:(i + 1) * k]))
            vals["lockstep/ratio"] = math.exp(vals["lockstep/ratio"] / max(1.0, vals["lockstep/calls"]))
            wrong = rule.over_limit(vals["lockstep/score"])  # some call of the step broke the rule
            vals["lockstep/wrong"] = float(wrong)
            self.history.append((step, wrong, vals["lockstep/err_candidate"], vals["lockstep/err_reference"],
                                 vals["lockstep/ratio"], vals["lockstep/score"]))
            out[step] = vals
        return out

    def _mutated_input(self):
        if self.mutation is None:
            return None
        return next((n for n, f in zip(self.tensor_names, self.mutation.cpu().tolist()) if f), None)

    def summary(self) -> dict:
        record = record_judgement(*zip(*[(h[0], h[4], h[5]) for h in self.history])) if self.history else \
            record_judgement([], [], [])
        worst = next((h for h in self.history if h[0] == record["worst_step"]), None)  # by score: the rule's worst
        by_step = record["spike_step"] is not None or record["count_step"] is not None
        return {
            "slot": self.slot, "candidate": self.impl.name, "checked_steps": len(self.history),
            "every": self.every, "wrong": record["wrong"], "first_wrong_step": record["onset"],
            "wrong_by_step": by_step, "first_step_over": next((h[0] for h in self.history if h[1]), None),
            "record": record,
            "wrong_steps": sum(1 for h in self.history if h[1]),
            "worst_step": worst[0] if worst else None,
            "worst_err_candidate": worst[2] if worst else None,
            "worst_err_reference": worst[3] if worst else None,
            "mutated_input": self._mutated_input(),
            "compiled_metrics": self.compiled,
            "check_graph": self.graphs.describe() if self.graphs is not None else "off (eager check)",
            "compile_fallback": self.compile_fallback,
            "error": self.error,
            "global_state": self.global_state,
            "rule": f"per call: err_candidate <= {RATIO} x err_reference + rounding floor, overall and per "
                    f"frequency bucket; wrong when one checked step is over {rule.SPIKE:g}x that limit, when "
                    f"{rule.OVER_COUNT} of any {rule.OVER_WINDOW} consecutive checked steps are over it, or when the "
                    f"median per-step err_candidate / err_reference exceeds {rule.RECORD_RATIO:g} over at least "
                    f"{rule.MIN_RECORD_STEPS} checked steps",
        }


def _graphs_wanted(recipe) -> bool:
    """Check graphs where the arm's body replays CUDA graphs too (`train.compile: inductor+cudagraphs` and
    `train.step_graph` on): on the device only, decided per call (CheckGraphs.fits)."""
    from ..model.transformer import uses_cudagraphs

    return bool(recipe.train.compile) and uses_cudagraphs(recipe.train.compile) and recipe.train.step_graph


class CheckGraphs:
    """The lockstep check's body as CUDA graphs (train/stepgraph.StepGraph, pure: an eager check, then one captured
    and replayed for every later call of the same input signature). The body is the harness's code only: the
    reference op, the oracle and the metrics on the copies of the inputs the check took, never the candidate,
    which has run before (in its own process, sandbox/). A replay copies the call's inputs and the candidate's
    outputs into the graph's own and hands back a copy of the row, so nothing the graph holds is read after its
    next replay. The graphs share one memory pool (they never replay at once). A capture that fails gives that
    signature's graph up with its reason (`describe`), and the check goes on eagerly.

    Memory: the graph keeps its copies of the inputs and outputs and its intermediates for the arm's life (at
    4096 x 65,536 the inputs and outputs are 2 GiB, the oracle's float64 embedding gradient 2 GiB more), where the
    eager check's intermediates went back to the allocator's cache, which kept them for the next check all the
    same."""

    MAX = 4  # input signatures with a graph of their own; more (a slot called at many shapes) run eagerly
    # Calls whose inputs and outputs are larger run eagerly. A graph pays off where the check is bound by its ~120
    # launches: at the h200 recipe (16,384 tokens, hidden 384, vocabulary 32,768: 64 MiB) the check every step cost
    # the candidate arm +1.37 ms a step with it against +2.53 and +4.74 eagerly (one H100 each, 2026-11-28,
    # `bench.py --recipe h200`). At
    # 8,192 tokens x hidden 4,096 x vocabulary 65,536 (1.6 GiB) the check's device time (float64 passes over the
    # 65,536 x 4,096 gradient) dwarfs its launches, and the graph would hold about 4 GiB more for the arm's life: there
    # every capture beside two other arms on an 80 GB card failed ("operation failed due to a previous error during
    # capture", each check then eager; alone it captured), seen in the default A/B and a soak of eight.
    MAX_BYTES = 256 << 20

    def __init__(self, capture=None):
        from ..train.stepgraph import SharedPool

        self.pool = SharedPool()
        self.graphs = {}  # signature -> StepGraph
        self.too_large = 0  # the largest call left eager for its size (bytes of its inputs and outputs)
        self.beyond = set()  # signatures past MAX, checked eagerly
        self._capture = capture  # injectable for tests (train/stepgraph.StepGraph's `capture`)

    def fits(self, device, inputs, cand) -> bool:
        """Whether this call goes through a graph: on CUDA (or with a test's capture), every output a tensor, and
        the call's inputs and outputs at most MAX_BYTES."""
        if not ((device.type == "cuda" or self._capture is not None) and all(isinstance(c, torch.Tensor)
                                                                               for c in cand)):
            return False
        size = sum(x.nbytes for x in (*inputs, *cand) if isinstance(x, torch.Tensor))
        if size > self.MAX_BYTES:
            self.too_large = max(self.too_large, size)
            return False
        return True

    def __call__(self, body, inputs, cand) -> torch.Tensor:
        consts = {i: x for i, x in enumerate(inputs) if not isinstance(x, torch.Tensor)}
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
        sig = (tuple(consts.items()),
               tuple((tuple(x.shape), x.stride(), x.dtype, x.device) for x in (*tensors, *cand)))
        graph = self.graphs.get(sig)
        if graph is None:
            if len(self.graphs) >= self.MAX:
                self.beyond.add(sig)
                return body(inputs, cand)
            from ..train.stepgraph import StepGraph

            graph = self.graphs[sig] = StepGraph(warmup=2, pure=True, unit="check", capture=self._capture,
                                                 pool=self.pool)
        n, size = len(tensors), len(inputs)

        def run(*flat):  # the call's arguments again, the graph's copies of its tensors in their places
            it = iter(flat[:n])
            return body([consts[i] if i in consts else next(it) for i in range(size)], tuple(flat[n:]))

        return graph(run, *tensors, *cand)

    def describe(self) -> str:
        """What went through graphs: each kind of outcome once, with how many signatures had it."""
        outcomes = [g.describe("g")["g"] for g in self.graphs.values()]
        said = [f"{outcomes.count(o)} input signature(s): {o}" for o in sorted(set(outcomes))]
        if self.beyond:
            said.append(f"{len(self.beyond)} more input signature(s) checked eagerly (graphs for {self.MAX} at most)")
        if self.too_large:
            said.append(f"eager for calls of {self.too_large / 2**20:.0f} MiB "
                        f"(graphs up to {self.MAX_BYTES >> 20} MiB)")
        return "; ".join(said) or "no call checked through a graph"
