"""CUDA-graph replay for the GPU tests of ops that must not sync with the host."""

from __future__ import annotations

import torch


def graph_replay(fn, refill):
    """``fn()`` warmed up on a side stream, captured in a CUDA graph (a host sync inside fails the capture),
    then ``refill()`` writes new inputs in place and the graph replays once. Returns (the replayed output,
    the graph: keep it while the output is read)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    refill()
    graph.replay()
    torch.cuda.synchronize()
    return captured, graph
