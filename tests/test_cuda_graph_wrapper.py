"""compiler/cuda_graph.py on the CPU, with torch.cuda's graph capture replaced by a stand-in that records the
captured call and re-runs it on replay (writing into the captured outputs, as a replay does): one capture per
batch descriptor, inputs copied in only when their address changed, the captured outputs returned, and a
piece called inside the whole forward's capture run inline (recorded by the outer capture), not captured or
replayed on its own."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

from compiled_llm.compiler import cuda_graph as CG

_capturing: list = []  # the stand-in graphs being captured, innermost last


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: the first Recorder call made while it captures registers itself
    (function, the static input, the output tensor); replay re-runs it and writes into that output."""

    def __init__(self):
        self.fn = self.args = self.result = None
        self.replays = 0

    def replay(self):
        self.replays += 1
        if self.fn is not None:
            self.result.copy_(self.fn.compute(*self.args))


@contextlib.contextmanager
def fake_capture(graph, pool=None):
    _capturing.append(graph)
    try:
        yield
    finally:
        _capturing.pop()


def _patched():
    return mock.patch.multiple(torch.cuda, CUDAGraph=FakeGraph, graph=fake_capture,
                               is_current_stream_capturing=lambda: bool(_capturing))


class Recorder:
    """fn(x) = x * 2 + 1, remembering which capture (if any) each call ran under."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def compute(x):
        return x * 2 + 1

    def __call__(self, x):
        graph = _capturing[-1] if _capturing else None
        self.calls.append(graph)
        out = self.compute(x)
        if graph is not None and graph.fn is None:
            graph.fn, graph.args, graph.result = self, (x,), out
        return out


def test_one_capture_per_descriptor_inputs_copied_outputs_reused():
    with _patched():
        fn = Recorder()
        w = CG.CUDAGraphWrapper("piece 0", pool=lambda: None)
        x = torch.arange(4.0)
        d4, d8 = CG.BatchDescriptor(4), CG.BatchDescriptor(8)
        g = w.capture(d4, fn, [x])
        assert fn.calls == [None, g.graph]  # a warm run outside, then the captured call
        out1 = w.run(d4, fn, [x])
        assert out1 is g.out and torch.equal(out1, x * 2 + 1) and g.graph.replays == 1
        y = torch.full((4,), 5.0)  # another address: copied into the captured input, the captured output reused
        out2 = w.run(d4, fn, [y])
        assert out2 is out1 and torch.equal(out2, y * 2 + 1) and torch.equal(g.static_args[0], y)
        assert g.static_args[0] is x  # the captured buffer, not the new tensor
        assert len(w) == 1 and d4 in w and d8 not in w and len(fn.calls) == 2  # replays never call fn
        z = torch.ones(8)
        out3 = w.run(d8, fn, [z])  # another descriptor captures its own graph on first use
        assert len(w) == 2 and torch.equal(out3, z * 2 + 1) and list(w) == [d4, d8]
        w.drop(d8)
        assert d8 not in w and len(w) == 1
        w.clear()
        assert len(w) == 0


def test_a_piece_inside_the_whole_forward_capture_runs_inline():
    with _patched():
        piece_fn = Recorder()
        pieces = CG.CUDAGraphWrapper("piece 0", pool=lambda: None)
        whole = CG.CUDAGraphWrapper("whole forward", pool=lambda: None)
        x = torch.arange(3.0)
        d = CG.BatchDescriptor(4)
        pieces.run(d, piece_fn, [x])  # the piecewise capture first (as choose_decode_graph does)
        piece_graph = pieces.graphs[d].graph
        replays = piece_graph.replays
        before = len(piece_fn.calls)

        def forward():
            return pieces.run(d, piece_fn, [x]) + 1

        g = whole.capture(CG.BatchDescriptor(4, whole=True), forward)
        # the warm run outside the capture replays the piece's own graph; inside the whole capture the piece
        # runs inline, recorded by the outer graph, and captures nothing of its own
        assert piece_graph.replays == replays + 1
        assert piece_fn.calls[before:] == [g.graph]
        assert len(pieces) == 1 and len(whole) == 1
        assert torch.equal(g.out, x * 2 + 2)
        assert str(CG.BatchDescriptor(8, whole=True)) == "whole decode, 8 tokens"


def test_only_the_whole_forwards_capture_lets_an_op_leave_work_to_a_later_op():
    """ops/context.py later_op_runs_with_this: inside a piece's capture the attention op between pieces runs after
    the graph, eagerly, so an op of the piece must not leave its kernel to it (qk_norm_rope_kv_write's deferral);
    inside the whole forward's capture both are recorded together; outside any capture both run eagerly."""
    from compiled_llm.ops.context import WHOLE_CAPTURE, later_op_runs_with_this

    cuda = torch.device("cuda")
    with _patched():
        seen = []

        def fn(x):
            seen.append((bool(_capturing), later_op_runs_with_this(cuda)))
            return x + 1

        x = torch.zeros(2)
        CG.CUDAGraphWrapper("piece 0", pool=lambda: None).capture(CG.BatchDescriptor(2), fn, [x])
        CG.CUDAGraphWrapper("whole forward", pool=lambda: None).capture(CG.BatchDescriptor(2, whole=True), fn, [x])
    assert seen == [(False, True), (True, False), (False, True), (True, True)]
    assert WHOLE_CAPTURE == [False]  # reset after the capture
