"""One input family's checks, run where the candidate lives (the probe's worker process, isolate.py): the call on
copies of the inputs, then checks.py's accuracy, mutation, determinism and caching checks against the float64 oracle
and the reference, whose outputs are prepared once per (family, seed) and kept in the run's Prepared, a small LRU. A
slot whose inputs include the model's parameters (`Contract.weights`) is also called after new values are written
into those in place, as an optimizer step writes them (`stale_weights`). Every call's outputs must be plain tensors
(`outputs` finding), and on a deep family the first call's must keep their values through the later calls
(`overwritten`; slots/outputs.py says why)."""
from __future__ import annotations

from collections import OrderedDict

import torch

from ...errors import OutputError
from ...slots.contract import as_tuple, copies, oracle_inputs
from ...slots.outputs import OVERWRITTEN, Kept, is_overwritten_error, output_problem
from ...rule import rel_error
from . import checks
from .inputs import family_seed
from .longrun import EarlierCall, long_run

REPEATS = 3  # runs of one input for the determinism check


def probe_family(contract, impl, fam, seed, device, destination, prepared: "Prepared") -> list:
    case, orc, ref = prepared.get(contract, fam, seed, device)
    ctx, kept = case.context, case.inputs
    slot = contract.name

    def call(inputs, repeat: int = 0):
        """The candidate on `inputs`, after `repeat` calls on fresh copies of them whose values nobody judges (the
        long run's: a failure among those, or outputs that are more than data, is an EarlierCall)."""
        out = _repeated(impl.fn, inputs, ctx, repeat, lambda o, i: output_problem(contract, o, i)) if repeat \
            else impl.fn(*inputs, **ctx)
        if device == "cuda":
            torch.cuda.synchronize()  # an asynchronous kernel error surfaces here, inside the guard
        said = output_problem(contract, out, inputs)  # plain tensors only (slots/outputs.py)
        if said:
            raise checks.NotData(said)
        return as_tuple(out)

    def failed(e, when=""):
        if isinstance(e, EarlierCall):
            e = e.error
        if isinstance(e, checks.NotData):
            return checks._finding("outputs", None, f"{when}{e}")
        if isinstance(e, OutputError):  # said by the candidate's kernel server (sandbox/client.py) in the same words
            return checks._finding("outputs", None, f"{when}{checks.one_line(e, slot)}")
        if is_overwritten_error(e):  # the candidate read an earlier output of its own, rewritten since
            return checks._finding("overwritten", None, f"{when}{OVERWRITTEN}")
        return checks._finding("exception", None, f"{when}{checks.one_line(e, slot)}")

    if fam.calls > 1:  # the long-run family: many calls, a sample of them judged (longrun.py)
        return long_run(contract, fam, seed, device, destination, prepared, call, failed)

    with torch.no_grad():
        given = copies(kept)
        try:
            cand = call(given)
        except Exception as e:
            return [failed(e)]
        out = checks.mutated_inputs(contract, given, kept)
        acc, errs = checks.accuracy(contract, cand, ref, orc, case.rows, destination)
        out += acc
        if not fam.deep:
            return out
        try:
            return out + _later_calls(contract, call, failed, kept, given, cand, orc, errs, prepared, fam, seed,
                                      device)
        except RuntimeError as e:  # reading the first call's outputs after a CUDA graph's replay rewrote them
            if not is_overwritten_error(e):
                raise
            return out + [checks._finding("overwritten", None, OVERWRITTEN)]


def _repeated(fn, inputs, ctx, repeat: int, problem):
    """`fn` on `inputs` after `repeat` calls on fresh copies of them, nobody waiting for those; each repeat's
    outputs must be plain data too (`problem(out, inputs)`: words or None, as every call's). In a kernel server
    (sandbox/) the server makes them (RemoteFunction.repeat_next), each at the cost of the candidate's own call:
    one at a time from here each paid a round trip and a sync (3,000 such calls took 7.8 s in a probe alone on an
    H100 and 18-128 s beside training arms, 2026-11-28). The copies are made where the call is made, after the
    loader's adapters (a destination-passing candidate's outputs are part of its inputs there)."""
    remote = getattr(getattr(fn, "fn", fn), "sandbox", None)  # (the probe's late-write watch wraps the call)
    if remote is not None:
        remote.repeat_next, remote.server.repeats_done = repeat, None
        try:
            return fn(*inputs, **ctx)
        except Exception as e:  # the server's reply said how many repeats returned (None: no reply to say it)
            done = remote.server.repeats_done
            if done is None or done < repeat:
                raise EarlierCall(done, e) from None
            raise
        finally:
            remote.repeat_next = 0  # (consumed by the call; not left for another should the adapters raise first)
    for i in range(repeat):
        given = copies(inputs)
        try:
            out = fn(*given, **ctx)
        except Exception as e:
            raise EarlierCall(i, e) from None
        said = problem(out, given)
        if said:
            raise EarlierCall(i, checks.NotData(said))
    return fn(*inputs, **ctx)


def _later_calls(contract, call, failed, kept, given, cand, orc, errs, prepared, fam, seed, device) -> list:
    """A deep family's calls after the first: determinism, then no caching. The first call's outputs are kept with
    a copy taken at the time (slots/outputs.py: Kept), and must still hold their values after each later call."""
    first, out = Kept(contract, cand, given), []

    def moved() -> list:
        return [checks._finding("overwritten", None, OVERWRITTEN)] if bool(first.changed()) else []

    # Determinism, and equal values in fresh storage: the same input, copied afresh, run again.
    runs, alive = [cand], []  # the copies stay alive, so later fresh tensors cannot take their addresses
    for k in range(REPEATS - 1):
        alive.append(copies(kept))
        try:
            runs.append(call(alive[-1]))
        except Exception as e:
            return out + [failed(e, f"run {k + 2} of {REPEATS} on the same input: ")]
    out += checks.spread(contract, runs, orc, errs)

    # No caching: another draw of the family written into the first call's storage, then in fresh tensors.
    case2, orc2, ref2 = prepared.get(contract, fam, seed, device, again=True)
    new = case2.inputs
    if any(isinstance(a, torch.Tensor) and a.shape != b.shape for a, b in zip(given, new)):
        return out  # a family whose shapes vary between draws: nothing to reuse
    if contract.weights:
        # An optimizer step: the other draw's weights written into the first call's weights, where a kernel that
        # keeps something by their address finds it again, with fresh activations
        args = tuple(a.copy_(b) if n in contract.weights else (b.clone() if isinstance(b, torch.Tensor) else b)
                     for n, a, b in zip(contract.inputs, given, new))
        how = f"after new values written in place into {', '.join(contract.weights)} (an optimizer step)"
        try:
            got = call(args)
        except Exception as e:
            return out + moved() + [failed(e, how + ": ")]
        said = moved()
        if said:
            return out + said
        out += checks.stale("stale_weights", contract, got, ref2, orc2, cand, errs, how)
    reused = tuple(a.copy_(b) if isinstance(a, torch.Tensor) else b for a, b in zip(given, new))
    for check, inputs, when, how in (
            ("reuse", lambda: reused, "new values in reused storage: ",
             "new values in the storage of the previous call's inputs"),
            ("fresh_storage", lambda: copies(new), "new values in fresh storage: ",
             "new values in fresh tensors after earlier calls")):
        try:
            got = call(inputs())
        except Exception as e:
            return out + moved() + [failed(e, when)]
        said = moved()  # new values: an overwritten first output differs from its copy now
        if said:  # and equals this call's answer, which stale() would call a cache
            return out + said
        out += checks.stale(check, contract, got, ref2, orc2, cand, errs, how)
    return out


class Prepared:
    """Families' inputs (never handed to the candidate: it gets copies), the oracle's and the reference's outputs,
    built once per (slot, family, shape, seed, device, draw) and kept while the owner lives: one probe (run_probe
    makes one), or several probes of one seed (the tests, the calibration table), which then build each input and
    its oracle once. A forked worker inherits its parent's; a spawned one builds its own."""

    # Whole sweeps: one slot's is 40 (cross_entropy) to 139 (rmsnorm_backward) entries on the CPU, and an LRU
    # scanned in order keeps nothing when it is smaller (at 32 a second probe of the same seed rebuilt every
    # entry). The sweeps of four slots held 357 MiB (2026-11-23, CPU); a second probe of a slot then took
    # 0.8-1.8 s against 1.4-2.2 s. Fresh seeds never hit.
    KEEP = 1024
    KEEP_BYTES = 4 << 30  # and at most ~4 GiB: at declared production shapes one entry holds 3.5 GiB (an fp64
    #                       oracle of 65,536 x 4096 is 2 GiB), beside training arms on the same GPU

    def __init__(self):
        self._held: "OrderedDict[tuple, tuple]" = OrderedDict()  # key -> (case, oracle, ref)

    def get(self, contract, fam, seed, device, again=False) -> tuple:
        """(case, oracle outputs, reference outputs) of one draw of a family."""
        # The build function is part of the key: declared-shape families reuse the synthetic families' names
        # (uniform, one-token, ...) with other inputs, and could share a shape with them.
        f = getattr(fam.build, "func", fam.build)  # a functools.partial: its function
        build = f"{getattr(f, '__module__', '')}.{getattr(f, '__qualname__', type(f).__name__)}"
        key = (contract.name, fam.name, build, fam.shape_str(), seed, device, again)
        hit = self._held.get(key)
        if hit is not None:
            self._held.move_to_end(key)
            return hit
        gen = torch.Generator().manual_seed(family_seed(seed, fam.name + ("/again" if again else "")))
        case = fam.build(gen, device)
        with torch.no_grad():
            orc = as_tuple(contract.oracle(*oracle_inputs(contract, case.inputs), **case.context))
            ref = as_tuple(contract.reference(*case.inputs, **case.context))
            if contract.orders is not None:
                ref = _worse_order(ref, as_tuple(contract.orders(*case.inputs, **case.context)), orc)
        self._held[key] = (case, orc, ref)
        while len(self._held) > self.KEEP or (len(self._held) > 1 and self._bytes() > self.KEEP_BYTES):
            self._held.popitem(last=False)
        return case, orc, ref

    def _bytes(self) -> int:
        return sum(x.numel() * x.element_size() for case, orc, ref in self._held.values()
                   for x in (*case.inputs, *orc, *ref) if isinstance(x, torch.Tensor))


def _worse_order(ref: tuple, other: tuple, orc: tuple) -> tuple:
    """Per output, the reference's or the same sum's in another order (Contract.orders), whichever is further from
    the oracle: the envelope every check of the probe measures against (slots/reduce.py: why)."""
    return tuple(o if o is not None and rel_error(o, x) > rel_error(r, x) else r for r, o, x in zip(ref, other, orc))
