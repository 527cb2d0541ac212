"""Pipelined calls: an arm's call to its kernel server returns before the server has answered.

An overlapped call (client.KernelServer.overlap) already orders the two processes' GPU work by interprocess events,
but the caller still waits on the host for the server's reply: the outputs' handles, what the candidate changed. That
round trip (2.1-2.6 ms of the host's a call on one H200, 2026-11-28/29) was most of what a candidate arm's step paid
over the reference arm's, and the device ran out of queued work meanwhile. A pipelined call takes the outputs' layout
from the calls before it with the same inputs' layout (shapes, strides, dtypes, which storage each output lives in,
which buffer the candidate will return: pipeline.next_token), sends, with the request, buffers of ours the server
copies the outputs into, and a word of our GPU memory the server's stream writes the call's number into after that
copy (kernel_server.stream_memops: cuStreamWriteValue32, fenced); our stream waits on the device for that number
(cuStreamWaitValue32) before it copies the outputs and the inputs back. Neither host waits. The reply is read at the
next call (or at `settle`, which an arm calls before each wait of its on the device that reaches its latest calls)
and checked against what was taken: the candidate's exception, outputs laid out otherwise, a subclass or a hook, are
then that call's error, one call late, and the arm stops on it (its outputs had already gone on to training); what it
changed of torch's global state is set here then, inside the next call, where the lockstep check's watch sees it.

A call is pipelined only where every tensor it hands over is a GPU tensor mapped by CUDA IPC, the calls before it
with that layout returned plain tensors on storages of the server's or in its inputs, the driver has the stream
memory operations, and a self-test of them on this process's stream passed (`KernelServer.platform["pipeline"]`,
which a candidate arm's arm.json keeps, says which, or why not).
"""
from __future__ import annotations

import json
import threading
import time
import weakref
from collections import OrderedDict
from typing import Optional

import torch

from . import kernel_server as wire

MAX_LAYOUTS = 8  # input layouts remembered (each with its output buffers, kept for the server's life)
# The most output buffers a candidate may cycle through, one per call, for a pipelined call's outputs to come back
# into the storage of ours that the same buffer's last output came back into, as they would in-process.
RING = 4
NOTE_KEYS = {"cls", "autograd", "hooks", "shadow", "layout"}  # what an output carried besides data


def signature(args_tree, kwargs_tree, descs: list, storages: list) -> Optional[str]:
    """The call's inputs' layout as one string, or None where a tensor does not go by CUDA IPC (a CPU tensor's
    bytes, and what the candidate writes into it, come back only in the reply)."""
    if not storages or any(s.get("via") not in ("ipc", "mapped") for s in storages):
        return None
    return json.dumps([args_tree, kwargs_tree, descs, [[s["n"], s["dev"]] for s in storages]],
                      separators=(",", ":"))


def _storage_shape(d: dict) -> dict:
    """What of a reply's output storage the layout depends on (not its token, not where it was sent from)."""
    if d.get("via") == "input":
        return {"via": "input", "input": d.get("input")}
    return {"via": "staged" if d.get("via") in ("ipc", "staged") else d.get("via"), "n": d.get("n"),
            "dev": d.get("dev")}


def next_token(history: list):
    """The buffer a call will return in one output storage's place, from the tokens its calls returned there
    (oldest first; the server's token stays the same while the candidate holds that buffer): the last one where the
    last two are the same (a buffer it keeps returning: a CUDA graph's output), the one a period back where the last
    two periods of 2 to RING calls are alike (a ring of buffers it cycles through), else None (a fresh buffer each
    call). A pipelined call's outputs go into the storage of ours the predicted buffer's last output came back into,
    so that a candidate that rewrites a buffer it returned before rewrites what its caller holds, as in-process."""
    if len(history) >= 2 and history[-1] is not None and history[-1] == history[-2]:
        return history[-1]
    for p in range(2, RING + 1):
        last = history[-p:]
        if len(history) >= 2 * p and None not in last and len(set(last)) == p and history[-2 * p:-p] == last:
            return history[-p]
    return None


class Pipeline:
    """One server's pipelined calls, from this (the trusted) side."""

    def __init__(self):
        self.on = None  # None until first tried; then True, or the reason in words why not
        self.memops = None
        self.layouts: "OrderedDict[str, dict]" = OrderedDict()
        self.last: "OrderedDict[str, dict]" = OrderedDict()  # the last plain reply's layout per inputs' layout
        self.flags: dict = {}  # device index -> [flag (int32, 1 element, from the staging pool), side stream, sent]
        self.buffers: dict = {}  # (layout, storage index) -> [buffer number, uint8 buffer, sent]
        self.next_id = 0
        self.drop: list = []  # buffer numbers the server may let go of
        self.seq = 0
        self.pending: Optional[dict] = None  # the call sent and not yet settled
        self._watch = None
        # The memory pool the flags and buffers above came from (client.KernelServer._pool_alloc), held last: this
        # object's attributes go in the order they were set, so its buffers return to the pool before this
        # object lets go of it (the pool itself is kept for the process's life: client._POOLS says why).
        self.pool = None

    # -- whether

    def ready(self, device, alloc) -> bool:
        """Whether this process can pipeline on `device`: the driver's stream memory operations, tried once on
        our stream with our own flag. `alloc(n, device)` is the server's staging allocator."""
        if self.on is None:
            self.memops = wire.stream_memops()
            if self.memops is None:
                self.on = "the CUDA driver has no stream memory operations (cuStreamWaitValue32)"
            else:
                try:
                    flag = alloc(4, device).view(torch.int32)
                    flag.zero_()
                    side = torch.cuda.Stream(device)
                    rc_w = self.memops[1](side.cuda_stream, flag.data_ptr(), 0, 0)
                    rc_a = self.memops[0](torch.cuda.current_stream(device).cuda_stream, flag.data_ptr(), 0,
                                          wire.WAIT_GEQ)
                    if rc_w or rc_a:
                        raise RuntimeError(f"CUresult {rc_w or rc_a}")
                    torch.cuda.current_stream(device).synchronize()
                    self.flags[device.index] = [flag, side, False]
                    self.on = True
                except Exception as e:  # noqa: BLE001 - any failure: calls stay as they are, said why
                    self.on = f"stream memory operations failed here ({type(e).__name__}: {e})"[:300]
        return self.on is True and device.index in self.flags

    def layout(self, sig: Optional[str]) -> Optional[dict]:
        if sig is None or self.on is not True:
            return None
        got = self.layouts.get(sig)
        if got is not None:
            self.layouts.move_to_end(sig)
        return got

    def learn(self, sig: Optional[str], h: dict) -> None:
        """After a call that was not pipelined and returned well: its outputs' layout, where it returned plain
        tensors laid out as the call's before it with the same inputs' layout."""
        if sig is None:
            return
        stores = h.get("out_storages") or []
        top = h.get("ret")
        now = {"ret": top, "tensors": h.get("out_tensors") or [], "storages": [_storage_shape(d) for d in stores],
               "tokens": [None if d.get("via") == "input" else d.get("token") for d in stores]}
        prev = self.last.get(sig)
        self.last[sig] = now
        self.last.move_to_end(sig)
        while len(self.last) > MAX_LAYOUTS:
            self.last.popitem(last=False)
        plain = (all(d.get("via") in ("ipc", "input") for d in stores)
                 and not any(set(d) & NOTE_KEYS for d in now["tensors"])
                 and not (isinstance(top, dict) and "cls" in top) and not h.get("hooks") and not h.get("changed"))
        if not plain or prev is None or any(prev[k] != now[k] for k in ("ret", "tensors", "storages")):
            return
        # Per output storage, the tokens its calls returned there (the last one last): what `due` predicts from
        history = [[p, t] for p, t in zip(prev["tokens"], now["tokens"])]
        self.layouts[sig] = {"ret": top, "tensors": now["tensors"], "storages": now["storages"], "history": history}
        self.layouts.move_to_end(sig)
        while len(self.layouts) > MAX_LAYOUTS:
            old, _ = self.layouts.popitem(last=False)
            for key in [k for k in self.buffers if k[0] == old]:
                self.drop.append(self.buffers.pop(key)[0])

    @staticmethod
    def due(layout: dict) -> list:
        """Per output storage of `layout`, the buffer its next call will return there (next_token), or None."""
        return [next_token(h) for h in layout["history"]]

    @staticmethod
    def observe(layout: dict, j: int, token) -> None:
        """A pipelined call's reply returned `token` in output storage `j`'s place (two periods of RING kept)."""
        history = layout["history"][j]
        history.append(token)
        del history[:-2 * RING]

    # -- a call

    def request(self, sig: str, layout: dict, device, alloc) -> tuple:
        """({"pipe": ...} for the request, [our output buffer per storage, None for an input's])."""
        self.seq = (self.seq + 1) & 0xFFFFFFFF
        flag = self.flags[device.index]
        pipe = {"seq": self.seq, "flag": None if flag[2] else wire.share_desc(flag[0].untyped_storage()),
                "outs": [], "drop": self.drop}
        flag[2] = True
        self.drop = []
        targets = []
        for j, d in enumerate(layout["storages"]):
            if d["via"] != "staged":
                targets.append(None)
                continue
            got = self.buffers.get((sig, j))
            if got is None:
                self.next_id += 1
                got = self.buffers[(sig, j)] = [self.next_id, alloc(wire._int(d["n"]), device), False]
            pipe["outs"].append([got[0], None if got[2] else wire.share_desc(got[1].untyped_storage())])
            got[2] = True
            targets.append(got[1])
        return pipe, targets

    def wait(self, device) -> None:
        """Our stream waits, on the device, for the server's stream to have written this call's number."""
        flag = self.flags[device.index][0]
        rc = self.memops[0](torch.cuda.current_stream(device).cuda_stream, flag.data_ptr(), self.seq, wire.WAIT_GEQ)
        if rc:
            raise RuntimeError(f"cuStreamWaitValue32 failed (CUresult {rc})")

    def abandon(self) -> None:
        """The pending call, if any, given up: our stream no longer waits for it (its server is gone or going)."""
        pending, self.pending = self.pending, None
        self.unblock(pending)

    def unblock(self, pending: Optional[dict]) -> None:
        """Writes a pending call's number ourselves, from a stream of its own: our stream no longer waits for a
        server that died, or whose error means it will not write it."""
        if pending is None:
            return
        flag = self.flags.get(pending["device"].index)
        if flag is None:
            return
        try:
            self.memops[1](flag[1].cuda_stream, flag[0].data_ptr(), pending["seq"], 0)
        except Exception:  # noqa: BLE001 - a broken context: nothing waits on it any more either
            pass

    def host_wait(self, pending: dict, timeout: float = 600.0) -> None:
        """The pending call's number waited for on the host, read from the flag through a stream of its own (where
        our stream could not be made to wait for it on the device)."""
        flag = self.flags[pending["device"].index]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with torch.cuda.stream(flag[1]):
                now = int(flag[0].item()) & 0xFFFFFFFF
            if ((now - pending["seq"]) & 0xFFFFFFFF) < 0x80000000:
                return
            time.sleep(0.0005)
        raise RuntimeError("the kernel server's stream never finished the call")

    def watch(self, proc) -> None:
        """Once: a thread that, should the server's process end while a call is pending, unblocks our stream (the
        arm may be waiting on its device on the host, e.g. for a loss, before its next call reads the end). The
        thread holds this object weakly: it never keeps our GPU memory alive, nor frees it from its own thread
        when it ends."""
        if self._watch is not None:
            return
        me = weakref.ref(self)

        def run():
            try:
                proc.wait()
            except Exception:  # noqa: BLE001
                return
            p = me()
            if p is not None:
                p.unblock(p.pending)

        self._watch = threading.Thread(target=run, name="kernel-server-watch", daemon=True)
        self._watch.start()

    def release(self) -> None:
        """Our flags and output buffers let go of, on the caller's thread (the server is closed)."""
        self.pending = None
        self.flags.clear()
        self.buffers.clear()
        self.layouts.clear()

    @staticmethod
    def unlike(h: dict, pending: dict) -> Optional[str]:
        """What a pipelined call's reply says that the layout it was taken under does not, in words; None where
        they agree."""
        lay = pending["layout"]
        stores = h.get("out_storages") or []
        if [_storage_shape(d) for d in stores] != lay["storages"]:  # (a "missed" storage is never "staged")
            return "its outputs in storages unlike the call's before it"
        if h.get("out_tensors") != lay["tensors"]:
            return "outputs of other shapes, strides or dtypes than the call's before it"
        if h.get("ret") != lay["ret"]:
            return "a return value shaped unlike the call's before it"
        if h.get("hooks"):
            return "a hook or a class put on an input"
        if h.get("changed"):
            return "writes into an input it had not written before"
        return None
