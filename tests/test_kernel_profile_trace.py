"""bench/kernel_profile.py trace's arithmetic on a hand-made timeline: early-launched kernels overlap,
so each kernel's share of the span is what it adds past the end of the kernels before it.

Seen red: with the share taken as the kernel's own duration (the overlap counted twice) the shares
add up to more than the span and the waiting kernel's share is its whole time; with the idle gap
not subtracted, the kernel after a gap is charged for it."""

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "kernel_profile", Path(__file__).resolve().parent.parent / "bench" / "kernel_profile.py")
kernel_profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kernel_profile)


def test_shares_add_up_to_the_span_less_idle_time():
    # (start, duration, name) in microseconds: b launched early inside a, c after a 5 us gap,
    # d entirely inside c (its time all overlapped)
    kernels = [(0.0, 10.0, "a(int)"), (4.0, 16.0, "b(float)"), (25.0, 10.0, "c()"), (27.0, 3.0, "d()")]
    totals, span = kernel_profile.timeline_totals(kernels, lambda name: name[0])
    assert span == pytest.approx(35e-3)
    share = {k: v[3] for k, v in totals.items()}
    idle = {k: v[2] for k, v in totals.items()}
    assert share == pytest.approx({"a": 10e-3, "b": 10e-3, "c": 10e-3, "d": 0.0})
    assert idle == pytest.approx({"a": 0.0, "b": 0.0, "c": 5e-3, "d": 0.0})
    assert sum(share.values()) + sum(idle.values()) == pytest.approx(span)
    assert totals["b"][:2] == [1, pytest.approx(16e-3)]  # the kernel's own time stays as measured


def test_short_names_keep_template_arguments():
    name = "void deltaspec_cuda::quantize_x256<(deltaspec_cuda::XFormat)0>(float const*, long, int)"
    assert kernel_profile.short_name(name) == "void deltaspec_cuda::quantize_x256<(deltaspec_cuda::XFormat)0>"
    nested = "void (anonymous namespace)::rows_deltanet<128>((anonymous namespace)::RowsArgs)"
    assert kernel_profile.short_name(nested) == "void (anonymous namespace)::rows_deltanet<128>"
