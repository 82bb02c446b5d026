"""benchmarks/peers.py: the measurement functions at a tiny shape (s3req beside AQT and Qwix)."""

import pathlib
import sys

import jax
import numpy as np
import pytest


pytest.importorskip("aqt.jax.v2", reason="aqtp is in the `peers` extra, not in `test`")
pytest.importorskip("qwix", reason="qwix is in the `peers` extra, not in `test`")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import peers  # noqa: E402


# aqtp 0.9.0 calls jnp.promote_types on arrays (a JAX deprecation warning, raised as an error
# by the project's filterwarnings); it is AQT's code, not ours
pytestmark = pytest.mark.filterwarnings(
    "ignore:Implicit conversion of an array to a dtype:DeprecationWarning"
)


@pytest.fixture(autouse=True)
def _standard_promotion():
    """Qwix multiplies int32 by float32 arrays: it needs JAX's standard dtype promotion (the
    project's conftest makes it strict)."""
    with jax.numpy_dtype_promotion("standard"):
        yield


STOCHASTIC = [n for n in peers.METHODS if "rtne" not in n]


def test_bias_statistic_separates_biased_from_unbiased():
    """z of the squared bias: below 5 for zero-mean noise, far above for a small offset."""
    rng = np.random.default_rng(0)
    ref = np.ones(1000)
    noise = rng.normal(size=(256, 1000))
    assert abs(peers._bias(noise, ref, 16)["bias2_z"]) < 5
    biased = peers._bias(noise + 0.3, ref, 16)
    assert biased["bias2_z"] > 5
    # the mean error's norm is the offset's plus the noise floor (0.3 and 1/16 per element)
    assert biased["mean_error_rel"] == pytest.approx(np.sqrt(0.3**2 + 1 / 256), rel=0.05)


@pytest.mark.slow
def test_quality_tiny_shape():
    q = peers.measure_quality((2, 8, 32, 64), "shared", n_keys=64, groups=16)
    assert set(q["rows"]) == set(peers.METHODS)
    for name, r in q["rows"].items():
        # every method's forward is the product of the operands executed_operands recovers
        assert r["forward_vs_executed_operands"] < 1e-5, name
        assert 0 < r["forward_error_vs_float"] < 0.05, name
        for which in ("dx", "dw"):
            assert 0 < r[which]["error_vs_float"] < 1.0, (name, which)
    for name in ("rtne", "aqt-rtne", "qwix-rtne"):  # deterministic: no noise over keys
        assert q["rows"][name]["dx"]["bias_vs_executed"]["noise_floor_rel"] < 1e-6
    for name in STOCHASTIC:
        assert q["rows"][name]["dx"]["bias_vs_executed"]["noise_floor_rel"] > 1e-4, name
    # s3req's two-way S3R-EC is unbiased against its executed forward: no bias at 5 sigma
    for which in ("dx", "dw"):
        z = q["rows"]["s3r-ec-2way"][which]["bias_vs_executed"]["bias2_z"]
        assert abs(z) < 5, (which, z)


@pytest.mark.slow
def test_main_writes_page_and_index(tmp_path):
    s = peers.main(
        ["--time-shape", "1x8x32x64", "--stats-shape", "1x4x16x32", "--keys", "32"]
        + ["--repeats", "2", "--out", str(tmp_path)]
    )
    sp = s["speed"]
    assert set(sp["time"]) == set(peers.METHODS)
    assert sp["ratio_to_rtne"]["rtne"]["median_s"] == pytest.approx(1.0)
    assert all(v >= 0 for v in sp["temp_bytes"].values())
    assert [q["weight"] for q in s["quality"]] == ["iid", "shared"]
    page = (tmp_path / "peers.md").read_text()
    assert "python benchmarks/peers.py --time-shape 1x8x32x64" in page
    assert all(peers.LABELS[n] in page for n in peers.METHODS)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "experiments"))
    import results_index

    (tmp_path / "index.md").write_text("# Results\n")
    text = results_index.main(["--dir", str(tmp_path)])
    assert "### The peers: AQT and Qwix" in text and "| qwix-sr |" in text
