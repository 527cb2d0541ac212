"""Pipelined calls to a kernel server (divergence/sandbox/pipeline.py): the layout a call is taken under, checked
against its reply (on the CPU), and the calls themselves on a GPU: what they give is what synchronous calls give,
a failure is its call's one call late, outputs laid out otherwise stop the arm, a server that dies unblocks our
stream."""
from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
from test_sandbox import OVERLAP_CANDIDATE, sandbox_on, swiglu_inputs, write  # noqa: F401 - sandbox_on: the fixture

from divergence.candidates.loader import load_candidate
from divergence.errors import CandidateError, OutputError
from divergence.sandbox.pipeline import Pipeline, signature


# ------------------------------------------------------------------------------------------ the layout, on CPU

def reply(tokens=(7,), n=256, shape=(8, 8), stride=(8, 1), **more) -> dict:
    """A server's reply to a call that returned one bf16 tensor per token, each in a storage of its own."""
    stores = [{"via": "ipc", "n": n, "dev": "cuda:0", "token": t, "start": 0, "ipc": {}} for t in tokens]
    tensors = [{"s": i, "dtype": "bfloat16", "shape": list(shape), "stride": list(stride), "offset": 0, "rg": False}
               for i in range(len(tokens))]
    ret = {"T": [{"t": i} for i in range(len(tokens))]} if len(tokens) > 1 else {"t": 0}
    return {"ok": True, "out_storages": stores, "out_tensors": tensors, "ret": ret, "hooks": [], "changed": [],
            **more}


def test_a_layout_is_learnt_from_two_plain_calls_and_says_which_buffers_are_kept():
    p = Pipeline()
    p.on = True
    sig = signature({"t": 0}, {"D": []}, [{"s": 0}], [{"n": 256, "dev": "cuda:0", "via": "ipc"}])
    assert sig is not None
    p.learn(sig, reply(tokens=(7, 8)))
    assert p.layout(sig) is None  # one call says nothing of which buffers the candidate keeps
    p.learn(sig, reply(tokens=(7, 9)))  # the first buffer returned again, the second fresh
    lay = p.layout(sig)
    # the kept buffer due again; the other fresh
    assert Pipeline.due(lay) == [7, None] and [h[-1] for h in lay["history"]] == [7, 9]
    assert [d["via"] for d in lay["storages"]] == ["staged", "staged"]
    # A CPU tensor among the inputs: its bytes (and the candidate's writes into it) come back only in the reply
    assert signature({"t": 0}, {"D": []}, [{"s": 0}], [{"n": 256, "dev": "cpu", "via": "buf"}]) is None


@pytest.mark.parametrize("tokens, due", [
    ([3, 3], 3),  # one buffer kept: a CUDA graph's output
    ([1, 2, 3, 4], None),  # a fresh buffer each call
    ([1, 2, 1, 2], 1),  # two buffers in turn
    ([5, 1, 2, 3, 1, 2, 3], 1),  # a ring of three
    ([1, 2, 3, 4, 1, 2, 3, 4], 1),  # of four (RING)
    ([1, 2, 3, 4, 5, 1, 2, 3, 4, 5], None),  # of five: past RING, taken as fresh
    ([1, 2, 1, 3], None),  # a ring broken
    ([2, 1, 2], None),  # one period seen: not yet a ring
    ([None, None], None),  # an input's place
])
def test_the_buffer_a_pipelined_call_will_return_is_predicted_from_the_tokens_before(tokens, due):
    """In-process, a candidate that returns a buffer it returned before rewrites what its caller may still hold;
    pipelined, its outputs must then come back into the storage of ours that buffer came back into last."""
    from divergence.sandbox.pipeline import next_token

    assert next_token(tokens) == due


def test_a_layout_follows_a_candidate_that_turns_to_a_ring_of_buffers():
    p = Pipeline()
    p.on = True
    p.learn("s", reply(tokens=(7,)))
    p.learn("s", reply(tokens=(8,)))
    lay = p.layout("s")
    assert Pipeline.due(lay) == [None]
    for tok, due in [(7, None), (8, 7), (7, 8), (8, 7)]:  # after two periods of two, the one due comes back
        p.observe(lay, 0, tok)
        assert Pipeline.due(lay) == [due] and lay["history"][0][-1] == tok
    assert len(lay["history"][0]) == 6
    for tok in range(100, 120):
        p.observe(lay, 0, tok)
    assert Pipeline.due(lay) == [None] and len(lay["history"][0]) == 8  # bounded: two periods of RING


@pytest.mark.parametrize("odd", [
    {"out_tensors": [{"s": 0, "dtype": "bfloat16", "shape": [8, 8], "stride": [1, 8], "offset": 0, "rg": False}]},
    {"out_tensors": [{"s": 0, "dtype": "bfloat16", "shape": [8, 8], "stride": [8, 1], "offset": 0, "rg": False,
                      "cls": "Two"}]},
    {"hooks": [[0, "hooks"]]},
    {"changed": [0]},
])
def test_a_call_returning_anything_but_plain_tensors_laid_out_as_before_is_never_pipelined(odd):
    """Learnt only from plain replies; and a pipelined call's reply unlike its layout is said in words."""
    p = Pipeline()
    p.on = True
    p.learn("s", reply())
    p.learn("s", dict(reply(), **odd))
    assert p.layout("s") is None
    p.learn("t", reply())
    p.learn("t", reply())
    pending = {"layout": p.layout("t")}
    assert p.unlike(reply(), pending) is None
    said = p.unlike(dict(reply(), **odd), pending)
    assert said and said.strip()


def test_a_reply_whose_outputs_were_not_staged_or_sized_otherwise_is_unlike_its_layout():
    p = Pipeline()
    p.on = True
    p.learn("s", reply())
    p.learn("s", reply())
    pending = {"layout": p.layout("s")}
    missed = reply()
    missed["out_storages"][0]["via"] = "missed"
    assert "storages" in p.unlike(missed, pending)
    assert "storages" in p.unlike(reply(n=512), pending)
    staged = reply()
    staged["out_storages"][0]["via"] = "staged"
    assert p.unlike(staged, pending) is None


def test_layouts_beyond_the_bound_let_their_buffers_go():
    from divergence.sandbox import pipeline

    p = Pipeline()
    p.on = True
    for i in range(pipeline.MAX_LAYOUTS + 2):
        p.learn(f"s{i}", reply())
        p.learn(f"s{i}", reply())
        p.buffers[(f"s{i}", 0)] = [i, None, True]
    assert len(p.layouts) == pipeline.MAX_LAYOUTS
    assert p.drop == [0, 1] and ("s0", 0) not in p.buffers


def test_calls_with_cpu_tensors_are_never_pipelined(tmp_path, sandbox_on):
    """An arm's server asked to pipeline, with CPU tensors (their bytes, and what the candidate writes into them,
    come back only in the reply): every call waits for its reply, nothing is tried, and settling is a no-op."""
    impl = load_candidate("swiglu", write(tmp_path, "plain.py", "def run(gate, up):\n    return gate * up\n"))
    server = impl.fn.sandbox.server
    server.overlap = server.pipeline = True
    gate, up = swiglu_inputs()
    for _ in range(8):
        assert torch.equal(impl.fn(gate, up), gate * up)
        assert server._pipe.pending is None
    server.settle()
    assert server.timing.calls == 8 and server.timing.pipelined == 0
    assert "pipeline" not in server.platform and server._pipe.on is None
    server.close()


# ----------------------------------------------------------------------------------------------- on a GPU

# Each call's inputs come out of long GPU work queued just before; the candidate sleeps on the device after
# returning, writes into its input `up` and returns a buffer it keeps: an unordered read anywhere sees stale values.
KEEPS = OVERLAP_CANDIDATE

FRESH = """
import torch

CALLS = [0]

def run(gate, up):
    CALLS[0] += 1
    torch.cuda._sleep(1_000_000)
    out = gate * up
    if CALLS[0] == 12:
        return out.t().contiguous().t()  # the same values, laid out otherwise
    if CALLS[0] == 14:
        return out.as_subclass(type("Two", (torch.Tensor,), {}))
    return out
"""


def _inputs(i: int):
    big = torch.randn(2048, 2048, device="cuda", generator=torch.Generator("cuda").manual_seed(i))
    x = big
    for _ in range(8):  # ~ms of device work ahead of the staging copies
        x = (x @ big).clamp_(-1, 1)
    gate = (x[:64, :128] + i).to(torch.bfloat16).contiguous()
    up = (x[64:128, :128] * 2 - i).to(torch.bfloat16).contiguous()
    return gate, up


def _server(tmp_path, name, body):
    impl = load_candidate("swiglu", write(tmp_path, name, body))
    server = impl.fn.sandbox.server
    server.overlap = server.pipeline = True
    return impl, server


@pytest.mark.gpu
def test_pipelined_calls_give_what_synchronous_calls_give(tmp_path, sandbox_on):
    impl, server = _server(tmp_path, "keeps.py", KEEPS)
    outs = []
    for i in range(12):
        gate, up = _inputs(i)
        expected_out, expected_up = gate * up, up + 1
        out, _, _ = server.call((gate, up), {})
        assert torch.equal(out, expected_out), f"call {i}: output"
        assert torch.equal(up, expected_up), f"call {i}: the input it wrote into"
        outs.append(out)
    assert server.platform["pipeline"] == "on", server.platform
    assert server.timing.pipelined >= 5
    # The buffer it keeps comes back into one storage of ours, as it would in-process: the last call's output
    # holds the last values in every output it returned
    assert outs[-1].data_ptr() == outs[-2].data_ptr() and torch.equal(outs[-2], outs[-1])
    gate, up = _inputs(20)
    gate[0, 0] = 1024.0
    server.call((gate, up), {})  # returns at once; the exception is the call's, read at the next
    with pytest.raises(ValueError) as e:
        server.settle()
    assert str(e.value) == "told to fail"
    torch.cuda.synchronize()  # our stream does not wait for a flag the failed call may not have written
    gate, up = _inputs(21)
    out, _, _ = server.call((gate, up), {})  # the server goes on
    assert torch.equal(out, gate * (up - 1))
    server.settle()
    server.close()


@pytest.mark.gpu
def test_a_pipelined_call_that_returns_otherwise_stops_at_the_next_call(tmp_path, sandbox_on):
    """Outputs laid out otherwise than the calls' before them (which training has already used as laid out
    before): an error naming it; a subclass: in slots/outputs.py's words, as a synchronous call's."""
    impl, server = _server(tmp_path, "fresh.py", FRESH)
    fn = impl.fn
    for i in range(11):
        gate, up = _inputs(i)
        assert torch.equal(fn(gate, up), gate * up)
    assert server.timing.pipelined >= 4
    fn(*_inputs(11))  # the 12th: laid out otherwise
    with pytest.raises(CandidateError, match="outputs of other shapes, strides or dtypes"):
        fn(*_inputs(12))
    torch.cuda.synchronize()
    fn(*_inputs(13))  # (the 13th taken synchronously: its layout follows no pipelined call's)
    server.call(_inputs(14), {})
    with pytest.raises(OutputError, match="subclass"):
        fn(*_inputs(15))
    server.close()


@pytest.mark.gpu
def test_a_server_that_dies_with_a_call_pending_does_not_leave_our_stream_waiting(tmp_path, sandbox_on):
    impl, server = _server(tmp_path, "keeps.py", KEEPS)
    server.on_death = "raise"
    for i in range(8):
        server.call(_inputs(i), {})
    assert server.timing.pipelined >= 1
    server.call(_inputs(9), {})
    assert server._pipe.pending is not None
    os.kill(server.pid, signal.SIGKILL)
    done = threading.Event()
    threading.Thread(target=lambda: (torch.cuda.synchronize(), done.set()), daemon=True).start()
    assert done.wait(30), "our stream still waits for the dead server's flag"
    with pytest.raises(CandidateError, match="died"):
        server.settle()


def test_the_watch_thread_never_keeps_the_pipeline_or_its_gpu_memory_alive():
    """The thread that unblocks our stream when a server dies holds the pipeline weakly: its buffers go when the
    server object goes, on the thread that drops it, not when the thread ends."""
    import gc
    import weakref

    class Proc:
        def __init__(self):
            self.done = threading.Event()

        def wait(self):
            self.done.wait(30)

    proc = Proc()
    p = Pipeline()
    p.watch(proc)
    thread, ref = p._watch, weakref.ref(p)
    del p
    gc.collect()
    assert ref() is None, "the watch thread keeps the pipeline alive"
    proc.done.set()
    thread.join(10)
    assert not thread.is_alive()


def test_an_arm_reads_its_servers_last_replies_before_each_wait_on_its_latest_steps(tmp_path, sandbox_on,
                                                                                     monkeypatch):
    """The last step's flush, and the final evaluation's, wait for the device to reach them; a pipelined call's
    stream waits for its server's flag, and a reply saying the server could not write it is read only when
    something settles the call. So between the last call and each such wait, the arm reads its servers' last
    replies. An `rmsnorm` candidate: the final evaluation calls it too (on the CPU nothing is pipelined: this is
    the order, which holds there as well)."""
    from divergence.recipe import load_recipe
    from divergence.sandbox import SANDBOXED
    from divergence.sandbox.client import KernelServer
    from divergence.train.arm import ArmSpec, run_arm
    from divergence.train.recorder import Recorder

    order = []
    call, settle, read, flush = KernelServer.call, KernelServer.settle, Recorder._read, Recorder.flush

    def calling(self, *a, **k):
        out = call(self, *a, **k)  # (its own settle of the call before comes first, inside)
        order.append("call")
        return out

    def settling(self):
        order.append("settle")
        return settle(self)

    def reading(self, keep):
        order.append(("read", keep))
        return read(self, keep)

    def flushing(self, final=False):
        order.append(("flush", final))
        return flush(self, final)

    monkeypatch.setattr(KernelServer, "call", calling)
    monkeypatch.setattr(KernelServer, "settle", settling)
    monkeypatch.setattr(Recorder, "_read", reading)
    monkeypatch.setattr(Recorder, "flush", flushing)
    r = load_recipe("tiny", {"train": {"steps": 3, "val_every": 1000, "snapshot_every": 0}})
    info = run_arm(r, ArmSpec("candidate", "sgd", {"rmsnorm": "zoo:rmsnorm_eps_fixed"}), tmp_path / "arm",
                   progress=False)
    assert info["status"] == "OK", info.get("error")
    assert info["isolation"]["rmsnorm"]["isolation"] == SANDBOXED
    finals = [i for i, e in enumerate(order) if e == ("flush", True)]
    assert any("call" in order[a:b] for a, b in zip(finals, finals[1:]))  # the final evaluation called it
    for f in finals:  # no call between a final flush's start and its wait: the settle must come there
        w = order.index(("read", 0), f)
        assert "settle" in order[f:w], f"{f}: {order}"


def test_the_last_pipelined_reply_read_at_the_end_of_an_arm_says_a_subclass_in_the_words_a_call_would():
    """An arm reads its servers' last replies itself (no call follows them): a subclass returned by the last call is
    said as slots/outputs.py says it of a call, and an unlike layout in the server's own words."""
    from divergence.sandbox.client import LateOutputs, RemoteFunction
    from divergence.slots import SLOTS

    class Server:
        def __init__(self, h):
            self.h = h

        def settle(self):
            raise LateOutputs("fresh: a call returned a return value shaped unlike the call's before it", self.h)

    sub = dict(reply(tokens=(7,)), out_tensors=[{"s": 0, "dtype": "bfloat16", "shape": [8, 8], "stride": [8, 1],
                                                 "offset": 0, "rg": False, "cls": "Sneaky"}])
    remote = RemoteFunction(Server(sub), SLOTS["swiglu"], "fresh", {})
    with pytest.raises(OutputError, match="subclass"):
        remote.settle()
    remote = RemoteFunction(Server(reply(tokens=(7,))), SLOTS["swiglu"], "fresh", {})
    with pytest.raises(LateOutputs, match="shaped unlike"):
        remote.settle()


def test_a_wrong_prediction_is_counted_and_leaves_no_two_buffers_of_theirs_in_one_storage_of_ours():
    """A candidate that kept one buffer returns a fresh one: the pipelined call's outputs went into the kept
    buffer's storage. Counted for arm.json; the kept buffer's next output then comes back into a storage of its own,
    not into the one now holding the fresh buffer's."""
    from divergence.sandbox.client import KernelServer

    p = Pipeline()
    p.on = True
    p.learn("s", reply(tokens=(7,)))
    p.learn("s", reply(tokens=(7,)))
    lay = p.layout("s")
    assert Pipeline.due(lay) == [7]
    server = KernelServer.__new__(KernelServer)  # its bookkeeping alone: no process
    server.mirrors, server.platform, server._pipe = {}, {}, p
    kept = torch.UntypedStorage(256)
    server._keep_mirror(7, kept)
    server._learn_tokens(reply(tokens=(7,)), {"layout": lay, "mirrors": {0: kept}, "due": [7]})
    assert "pipeline_mispredicted" not in server.platform and server._mirror_of(7) is kept
    server._learn_tokens(reply(tokens=(9,)), {"layout": lay, "mirrors": {0: kept}, "due": [7]})
    assert server.platform["pipeline_mispredicted"] == 1
    assert server._mirror_of(9) is kept and server._mirror_of(7) is None
    assert Pipeline.due(lay) == [None] and lay["history"][0][-1] == 9
