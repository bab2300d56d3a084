"""bench/kv_transform_gain.py's bounds: reverse water-filling over a covariance spectrum and the
rate table that decides whether issue 27's "tq3 no worse than q4_0 at 2/3 of its bytes" is reachable.

Seen to fail once with a planted bug: water_filling without the clip D_i = min(theta, eig_i)
(theta for every component, patched by hand) -> the spectrum with an eigenvalue under the water
level gives 0.1249 instead of 1.01 / 16.01 = 0.0631.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import kv_transform_gain as ktg  # noqa: E402


def test_water_filling_known_answers():
    # isotropic: the Gaussian bound 2^(-2R) itself
    assert ktg.water_filling(np.ones(64), 3.0) == pytest.approx(2.0 ** -6)
    # every eigenvalue above the water level: GM / AM * 2^(-2R); (4, 1) at 1 bit: 0.8 * 0.25
    assert ktg.water_filling(np.array([4.0, 1.0]), 1.0) == pytest.approx(0.2)
    # (16, 0.01) at 1 bit: both bits go to the first component (theta = 1), the second is dropped
    assert ktg.water_filling(np.array([16.0, 0.01]), 1.0) == pytest.approx(1.01 / 16.01)


def test_rate_bounds_order():
    rows = {r["rate"]: r for r in ktg.rate_bounds(64)}
    assert rows[3.0]["shannon"] == 2.0 ** -6 and rows[4.5]["shannon"] == 2.0 ** -9
    for R in (3.0, 4.0):
        # a fixed-rate scalar code sits above the bound; Max's table: 0.03455 (8 levels), 0.009497 (16)
        assert rows[R]["shannon"] < rows[R]["lloyd_max_gauss"]
    assert rows[3.0]["lloyd_max_gauss"] == pytest.approx(0.03455, rel=1e-3)
    assert rows[4.0]["lloyd_max_gauss"] == pytest.approx(0.009497, rel=1e-3)
