"""What the attention kernels' tests share (``test_triton_attention.py``,
``test_mosaic_attention.py``, ``test_conformance_attention.py``): comparing a kernel's results
with the reference's."""

import numpy as np


def assert_close(got, want, rtol=1e-5, what=""):
    """Equal NaN and non-finite patterns (and infinities), finite values within ``rtol`` of
    ``want``'s largest magnitude."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.max(np.abs(np.where(np.isfinite(want), want, 0.0))) or 1.0
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN")
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want), err_msg=what)
    np.testing.assert_array_equal(got[np.isinf(want)], want[np.isinf(want)], err_msg=what)
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=rtol * scale, err_msg=what)
