"""Smoke runs of the paper-reproduction scripts in `experiments/` (tiny sizes, into tmp_path),
so that the scripts behind `docs/results/` cannot rot."""

import importlib.util
import json
import math
import pathlib
import platform
import subprocess
import sys

import pytest


EXPERIMENTS = pathlib.Path(__file__).resolve().parent.parent / "experiments"


def _load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    if str(EXPERIMENTS) not in sys.path:  # the scripts import each other, as when run
        sys.path.append(str(EXPERIMENTS))
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_table1_smoke_resumable(tmp_path):
    t1 = _load("table1_quality")
    args = ["--scale", "smoke", "--configs", "bf16,s3r", "--out", str(tmp_path)]
    summary = t1.main(args)
    runs = (tmp_path / "table1_smoke_runs.jsonl").read_text().splitlines()
    assert len(runs) == 4  # 2 configurations x 2 seeds, one learning rate
    rows = summary["rows"]
    assert set(rows) == {"bf16", "s3r"}
    assert all(math.isfinite(v) for r in rows.values() for v in r["val_losses"])
    assert rows["bf16"]["gap_bf16"] == 0.0
    for suffix in (".md", ".json", ".png"):
        assert (tmp_path / f"table1_smoke{suffix}").stat().st_size > 0
    # A rerun trains nothing new and reproduces the table.
    again = t1.main(args)
    assert len((tmp_path / "table1_smoke_runs.jsonl").read_text().splitlines()) == 4
    assert again["rows"]["s3r"]["val_losses"] == rows["s3r"]["val_losses"]
    # A page on fewer seeds than the scale's trains nothing, says so and lists the runs it
    # leaves out.
    one = t1.main(args + ["--seeds", "1"])
    assert [tuple(r) for r in one["unused_runs"]] == [("bf16", 1), ("s3r", 1)]
    text = (tmp_path / "table1_smoke.md").read_text()
    assert "uses 1 of the scale's 2 seeds" in text and "2 run(s) of seed(s) 1" in text


def test_table1_tests():
    """The tests of the orderings: Student-t p-values and critical values, the paired t, the
    verdicts (holds / reversed / not resolved, ties) and the Holm correction."""
    t1 = _load("table1_quality")
    # Two-sided 5% critical values of Student's t (tables: 12.706, 4.303, 2.571, 2.228).
    for dof, crit in ((1, 12.706), (2, 4.303), (5, 2.571), (10, 2.228)):
        assert abs(t1.t_critical(dof) - crit) < 2e-3
    assert abs(t1.t_pvalue(2.571, 5) - 0.05) < 1e-3
    assert math.isnan(t1.t_pvalue(float("nan"), 5))
    t, dof, se = t1.paired([1.0, 2.0, 3.5], [0.0, 1.0, 2.0])
    d = [1.0, 1.0, 1.5]
    sd = math.sqrt(sum((x - 7 / 6) ** 2 for x in d) / 2)
    assert dof == 2 and math.isclose(se, sd / math.sqrt(3)) and math.isclose(t, (7 / 6) / se)
    base = [1.80, 1.79, 1.81, 1.78, 1.82, 1.80]
    noise1 = [0.001, -0.002, 0.0015, -0.001, 0.0005, 0.0]
    noise2 = [-0.0005, 0.001, 0.0, 0.002, -0.001, -0.0015]

    def row(shift, noise):
        vals = [b + shift + n for b, n in zip(base, noise)]
        return {"val_losses": vals, "mean": sum(vals) / len(vals)}

    # sr above bf16 by 0.01 (holds), rtne 0.01 below sr (reversed), the rest equal to sr.
    rows = {c: row(0.0, noise1) for c in t1.CONFIGS}
    rows["bf16"] = row(-0.01, noise2)
    rows["rtne"] = row(-0.01, noise2)
    got = {(c["a"], c["b"]): c for c in t1.claims(rows)}
    assert got[("sr", "bf16")]["verdict"].startswith("holds") and got[("sr", "bf16")]["holm"]
    assert got[("rtne", "sr")]["verdict"].startswith("REVERSED")
    assert not got[("rtne", "sr")]["holm"]
    lo, hi = got[("sr", "bf16")]["ci95"]
    assert lo < 0.01 < hi
    # Identical per-seed values: the paired t is undefined.
    assert got[("s3r", "sr")]["verdict"] == "undetermined"
    rows["s3r"] = row(0.0, noise2)
    got = {(c["a"], c["b"]): c for c in t1.claims(rows)}
    assert got[("s3r", "sr")]["verdict"].startswith("not resolved")
    assert got[("s3r-ec-2way", "sr")]["tie"]


def test_table1_welch():
    t1 = _load("table1_quality")
    t, dof = t1.welch([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    assert t == 0.0 and math.isclose(dof, 4.0)
    t, _ = t1.welch([2.0, 2.1, 1.9], [1.0, 1.1, 0.9])
    assert math.isclose(t, 1.0 / math.sqrt(2 * 0.01 / 3))
    assert math.isnan(t1.welch([1.0], [2.0, 3.0])[0])


def test_table1_engines_section():
    """The runs' engines: a recorded commit wins, older runs take `UNRECORDED_ENGINE`; a rerun
    is compared with its stored run (bitwise, and the first logged step that differs); the
    page names every seed's engine and the largest drift."""
    t1 = _load("table1_quality")

    def rec(config, seed, curve, **extra):
        return {
            "config": config,
            "lr": 3e-3,
            "seed": seed,
            "final_val_loss": curve[-1][1],
            "val_curve": curve,
            "train_curve": curve,
            **extra,
        }

    stored = {
        t1.run_key(c, 3e-3, 0): rec(c, 0, [[0, 5.0], [10, 4.0], [20, 3.0]])
        for c in ("bf16", "s3r-ec-2way")
    }
    assert t1.engine_of(stored[t1.run_key("bf16", 3e-3, 0)]) == t1.UNRECORDED_ENGINE[0]
    assert t1.engine_of(rec("bf16", 9, [[0, 1.0]], commit="abc")) == "abc"
    assert t1.engine_of(rec("bf16", 99, [[0, 1.0]])) == "not recorded"
    reruns = {
        t1.run_key("bf16", 3e-3, 0): rec("bf16", 0, [[0, 5.0], [10, 4.0], [20, 3.0]], commit="n"),
        t1.run_key("s3r-ec-2way", 3e-3, 0): rec(
            "s3r-ec-2way", 0, [[0, 5.0], [10, 4.1], [20, 3.25]], commit="n"
        ),
    }
    got = {c["config"]: c for c in t1.compare_rechecks(stored, reruns)}
    assert got["bf16"]["identical"] and got["bf16"]["first_train_step_differing"] is None
    ec = got["s3r-ec-2way"]
    assert not ec["identical"] and ec["first_train_step_differing"] == 10
    assert math.isclose(ec["rerun"] - ec["stored"], 0.25)
    same = {"identical": True, "rel_norm": 0.0}
    probe = {
        "checkout": "n",
        "presets": ["sr", "s3r-ec-2way"],
        "engines": {
            "05a59a9": {
                "sr/dx": same,
                "s3r-ec-2way/out": same,
                "s3r-ec-2way/dx": {"identical": False, "rel_norm": 4.2e-8},
            },
            "m": {"sr/dx": same, "s3r-ec-2way/out": same, "s3r-ec-2way/dx": same},
        },
    }
    text = "\n".join(
        t1.engines_markdown(
            {
                "engines": {"0": {"05a59a9": ["bf16"]}, "4": {"n": ["sr"], "m": ["bf16"]}},
                "rechecks": list(got.values()),
                "engine_probe": probe,
            }
        )
    )
    assert "| 0 | `05a59a9` |" in text and "| 4 | `n` (Independent SR); `m` (BF16) |" in text
    assert "moved its final loss by 0.2500" in text
    assert "the reruns of BF16 above reproduce" in text
    assert "`sr` are bitwise identical on every engine" in text
    assert "`s3r-ec-2way` 4.2e-08" in text
    assert "`m` computes bitwise the same as `n` for every preset" in text
    assert "`05a59a9` compute" not in text
    # One engine for every run and no reruns: the section says so and nothing about mixing.
    one = "\n".join(t1.engines_markdown({"engines": {"0": {"n": ["sr"]}, "1": {"n": ["sr"]}}}))
    assert "Every run was trained by one engine, `n`" in one
    assert "stays paired" not in one and "| seed |" not in one


def test_table1_engines_to_probe(tmp_path):
    """The engine probe's default commits: every engine the runs and reruns name, once (an
    abbreviation of any length), without the checkout's own or runs that name no commit."""
    t1, t1e = _load("table1_quality"), _load("table1_engines")
    old = t1.UNRECORDED_ENGINE[0]

    def git(*args):
        return subprocess.run(
            ["git", "-C", str(EXPERIMENTS.parent), *args], capture_output=True, text=True
        )

    if git("rev-parse", "--verify", f"{old}^{{commit}}").returncode != 0:
        pytest.skip(f"needs a git checkout holding the old engine {old} (not shallow)")
    head = git("rev-parse", "HEAD").stdout.strip()
    prev = git("rev-parse", "HEAD~1").stdout.strip()

    def rec(seed, **extra):
        return json.dumps({"config": "sr", "lr": 3e-3, "seed": seed, **extra})

    (tmp_path / "table1_cpu_runs.jsonl").write_text(
        "\n".join(
            [
                rec(0),  # UNRECORDED_ENGINE[0]
                rec(1, commit=prev[:7]),
                rec(2, commit=prev[:12]),  # the same commit again
                rec(3, commit=head[:12]),  # the checkout's own
                rec(99),  # not recorded
                rec(4, commit=prev[:7] + "+dirty"),
            ]
        )
        + "\n"
    )
    (tmp_path / "table1_cpu_recheck.jsonl").write_text(rec(0, commit=prev) + "\n")
    assert t1e.run_engines(tmp_path, head[:12] + "+dirty") == [old, prev[:7]]
    # A commit that does not exist is an error, not a silently skipped engine.
    (tmp_path / "table1_cpu_recheck.jsonl").write_text(rec(0, commit="0" * 12) + "\n")
    with pytest.raises(ValueError, match="no commit '000000000000'"):
        t1e.run_engines(tmp_path, head[:12])


@pytest.mark.slow
def test_table2_smoke(tmp_path):
    t2 = _load("table2_gradient_error")
    summary = t2.main(["--smoke", "--rows", "rtne,s3r-ec-2way", "--out", str(tmp_path)])
    rows = summary["rows"]
    assert list(rows) == ["INT8 RTNE (reference)", "S3R-EC, two-way (Phi2D)"]
    for r in rows.values():
        assert all(0 < v < 10 for v in r["mean"])
    # RTNE is deterministic: every key gives the same gradient.
    rtne = rows["INT8 RTNE (reference)"]
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(rtne["mean"], rtne["bias_floor"]))
    assert (tmp_path / "table2.md").read_text().startswith("# Table II")


def test_prop1_isolated_gemm():
    """Proposition 1 in the setting it assumes: for one GEMM with Gaussian x and G, the
    measured Phi2D / SR ratio of the dX noise norms is `sqrt((1 + R) / 2)`, within 5 standard
    errors, for weights without (R ~ 1) and with a common component of their rows (R >> 1)."""
    _load("table2_gradient_error")
    tw = _load("table2_width")
    import jax.numpy as jnp
    import jax.random as jr

    import policies

    w = jr.normal(jr.key(1), (64, 32))
    assert math.isclose(tw.row_sum_ratio(w[:1]), 1.0)  # D = 1: no sum
    assert math.isclose(tw.row_sum_ratio(jnp.broadcast_to(w[:1], (64, 32))), 64.0)  # R = D
    x, g = jr.normal(jr.key(2), (4, 32, 32)), jr.normal(jr.key(3), (4, 32, 64))
    keys = jr.split(jr.key(4), 16)
    for common in (0.0, 0.3):
        wc = common + 0.3 * w
        r = tw.row_sum_ratio(tw.codes(wc))
        assert (r > 20) == (common > 0)
        a = tw.gemm_noise(wc, policies.preset("s3r"), x, g, keys)
        b = tw.gemm_noise(wc, policies.preset("sr"), x, g, keys)
        q, se = tw._sqrt_ratio(a, b)
        assert abs(q - tw.predicted_ratio(r)) < 5 * se, (common, q, se, r)


def test_noise_from_errors():
    """The rounding noise recovered from the per-key errors and the bias floor equals the
    key-to-key spread of the gradients themselves."""
    import numpy as np

    tw = _load("table2_width")
    rng = np.random.default_rng(0)
    exact = rng.normal(size=50)
    g = exact + 0.1 + 0.3 * rng.normal(size=(8, 50))
    norm = np.linalg.norm(exact)
    errs = np.linalg.norm(g - exact, axis=1)[:, None] / norm
    floor = [np.linalg.norm(g.mean(axis=0) - exact) / norm]
    noise = tw.noise_energy(errs, floor)
    direct = ((g - g.mean(axis=0)) ** 2).sum() / 7 / norm**2
    assert math.isclose(noise.mean(), direct, rel_tol=1e-9)


@pytest.mark.slow
def test_table2_width_quick(tmp_path):
    _load("table2_gradient_error")
    tw = _load("table2_width")
    s = tw.main(["--quick", "--out", str(tmp_path)])
    assert [w["width"] for w in s["widths"]] == list(tw.SWEEPS["quick"].widths)
    for w in s["widths"]:
        assert set(w["rows"]) == set(tw.ROWS)
        assert w["rows"]["rtne"]["n_keys"] == 1 and w["rows"]["sr"]["n_keys"] > 1
        for r in w["rows"].values():
            assert all(0 < v < 10 for v in r["mean"]) and all(v >= 0 for v in r["sem"])
        for v in w["ratios_vs_sr"].values():
            assert all(math.isfinite(x) and x > 0 for x in v["total"] + v["total_se"])
        # Two-way S3R-EC below Independent SR at the layer-0 dX, as in the paper's Table II.
        assert w["ratios_vs_sr"]["s3r-ec-2way"]["total"][0] < 1
        for k in tw.KINDS:
            v = w["weights"][k]
            assert all(r > 0 for r in v["R_codes"]) and len(v["R_codes"]) == 2
            assert math.isfinite(w["gemm"][k]["ratio"])
    text = (tmp_path / "table2_width.md").read_text()
    assert text.startswith("# Table II across widths") and "Reading (generated" in text
    assert (tmp_path / "table2_width.png").stat().st_size > 0
    index = _load("results_index")
    assert "### Table II across widths" in index.main(["--dir", str(tmp_path)])
    # A rerun reuses every width of the runs file and writes the same page.
    again = tw.main(["--quick", "--out", str(tmp_path)])
    assert again["widths"] == json.loads(json.dumps(s["widths"]))


def test_table3_smoke(tmp_path):
    t3 = _load("table3_ffn_speed")
    summary = t3.main(
        ["--smoke", "--repeats", "1", "--allocator", "current", "--out", str(tmp_path)]
    )
    (row,) = summary["rows"]
    assert set(row["median_s"]) == set(t3.POLICIES)
    assert all(t > 0 for t in row["median_s"].values())
    assert json.loads((tmp_path / "table3_ffn_speed.json").read_text())["meta"]["mode"] == "smoke"
    # absolute times only on an accelerator, and the reading names it
    assert "Median times" not in (tmp_path / "table3_ffn_speed.md").read_text()
    gpu = dict(summary, meta=dict(summary["meta"], device="NVIDIA H200"))
    text = t3.markdown(gpu)
    assert "Median times on NVIDIA H200 (ms)" in text and "this CPU" not in text
    # the host's load and malloc say nothing about a GPU's times
    assert "load average" not in text and "malloc" not in text
    # --pages rewrites the page from its JSON
    page = tmp_path / "table3_ffn_speed.md"
    cpu_text = page.read_text()
    page.unlink()
    t3.main(["--smoke", "--pages", "--out", str(tmp_path)])
    assert page.read_text() == cpu_text


def test_table3_cpu_shapes():
    t3 = _load("table3_ffn_speed")
    for h, d in t3.models.PAPER_FFN_SHAPES.values():
        h2, d2, tokens, scaled = t3.cpu_shape(h, d)
        assert tokens >= t3.MIN_TOKENS and h2 % 128 == 0 and d2 % 128 == 0
        assert h2 * d2 * tokens <= 1.1 * t3.BUDGET
        assert scaled == ((h2, d2) != (h, d))


@pytest.mark.slow
def test_table4_smoke(tmp_path):
    t4 = _load("table4_full_step")
    summary = t4.main(["--smoke", "--allocator", "current", "--out", str(tmp_path)])
    (speed,) = summary["speed"].values()
    assert set(speed["median_s"]) == {"bf16", "sr", "s3r"}
    mem = summary["memory"]["tiny"]["policies"]
    assert mem["rtne"]["total_bytes"] > 0
    # S3R keeps the residuals and the int8 gradient of RTNE: the same compiled memory up to
    # the few threshold words (576 bytes at this size).
    assert (
        abs(mem["s3r"]["total_bytes"] - mem["rtne"]["total_bytes"])
        <= 0.01 * mem["rtne"]["total_bytes"]
    )


def test_theory_smoke(tmp_path):
    th = _load("theory")
    res = th.main(["--smoke", "--out", str(tmp_path)])
    # Exact enumeration: the 7-bit bias never exceeds delta/256 (and reaches it).
    assert res["bias"]["max_abs_bias"] <= 1 / 256 + 1e-9
    assert math.isclose(res["bias"]["max_abs_bias"], 1 / 256, rel_tol=1e-4)
    l2 = res["lemma2"]
    assert abs(l2["mean_variance"] - 1 / 6) < 0.01
    assert abs(l2["mean_pair_covariance"] - 1 / 12) < 0.01
    assert l2["min_pair_covariance"] >= 0
    for layer in res["theorem1"]["layers"].values():
        assert layer["max_abs_avg_var_drop_minus_var_of_mean"] < 1e-9
        assert layer["summed_variance_fall"] > 0
    for name in ("lemma1", "lemma2", "theorem1", "bias"):
        assert (tmp_path / f"theory_{name}.png").stat().st_size > 0
    # The index summary: theory filled in, the other tables listed as not generated, the
    # text around the markers kept on a rerun.
    index = _load("results_index")
    (tmp_path / "index.md").write_text("# Results\n\nkept\n")
    index.main(["--dir", str(tmp_path)])
    text = index.main(["--dir", str(tmp_path)])
    assert text.count(index.START) == 1 and "kept" in text
    assert "### Theory" in text and "Table I: not generated yet" in text


def _bench_qdot():
    benchmarks = str(EXPERIMENTS.parent / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    import bench_qdot

    return bench_qdot


@pytest.mark.slow
def test_bench_qdot_smoke(tmp_path):
    bq = _bench_qdot()
    out = tmp_path / "qdot_speed"
    summary = bq.main(
        ["--shapes", "1x8x64x128", "--repeats", "1", "--allocator", "current"]
        + ["--moe", "tiny-moe", "--moe-budget", "1e8", "--out", str(out)]
    )
    (run,) = summary["runs"]
    assert run["allocator"] == bq.allocator_mode()
    (row,) = run["rows"]
    for field in ("fwd_bwd_s", "minor_faults_per_call", "temp_bytes"):
        assert set(row[field]) == set(bq.POLICIES)
    assert all(t > 0 for t in row["fwd_bwd_s"].values())
    assert all(b >= 0 for b in row["temp_bytes"].values())
    (moe,) = run["moe_rows"]  # tiny-moe at 512 tokens, its widths (within the budget)
    assert (moe["rows"], moe["h"], moe["d"], moe["scaled"]) == (1024, 128, 128, True)
    assert set(moe["fwd_bwd_s"]) == set(bq.MOE_POLICIES)
    assert sum(moe["group_sizes_min_max"]) > 0 and all(t > 0 for t in moe["fwd_bwd_s"].values())
    gemms = run["gemms"]  # this CPU's GEMM speeds, said on the page
    assert set(gemms["gops"]) == {"int8", "bf16_f32", "bf16"}
    assert all(v > 0 for v in gemms["gops"].values())
    text = out.with_suffix(".md").read_text()
    assert text.startswith("# qdot speed") and "## Targets" in text
    assert f"int8 with int32 sums {gemms['gops']['int8']:.0f} GOP/s" in text
    assert "## qragged_dot on the MoE presets" in text and "| tiny-moe |" in text


def test_gemm_text_says_what_the_speeds_show():
    bq = _bench_qdot()
    gemms = {"cpu": "X", "flags": ["amx_int8"], "shape": [8, 4, 2]}
    faster = bq.gemm_text(gemms | {"gops": {"int8": 300.0, "bf16_f32": 200.0, "bf16": 100.0}})
    assert "int8 with int32 sums 300 GOP/s" in faster and "runs at 1.50x" in faster
    assert "holds a GEMM speedup" in faster and "amx_int8" in faster
    even = bq.gemm_text(
        gemms | {"flags": [], "gops": {"int8": 204.0, "bf16_f32": 100.0, "bf16": 200.0}}
    )
    assert "runs at 1.02x" in even and "vector work alone" in even
    assert "no AMX, VNNI or AVX512-BF16" in even
    assert "not recorded" in bq.gemm_text(None)  # pages from JSON written before the field


def test_allocator_modes():
    bq = _bench_qdot()
    warm, default = bq.allocator_env("warm"), bq.allocator_env("default")
    assert all(warm[k] == v for k, v in bq.WARM_ALLOCATOR.items())
    assert not set(bq.WARM_ALLOCATOR) & set(default)
    with pytest.raises(ValueError, match="allocator mode"):
        bq.allocator_env("pooled")
    other = "default" if bq.allocator_mode() == "warm" else "warm"
    with pytest.raises(RuntimeError, match="fresh process"):  # never restarts pytest itself
        bq.run_with_allocator(other, bq.__file__)
    bq.run_with_allocator("current", bq.__file__)  # no-op


_FAULTS = """
import resource, sys, threading
import numpy as np
def run(out):
    total = 0
    for i in range(5):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        a = np.empty(int(sys.argv[1]) * 2**20, np.uint8)
        a.fill(1)  # touch every page
        del a
        if i:
            total += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    out.append(total)
main, worker = [], []
run(main)
t = threading.Thread(target=run, args=(worker,))  # an XLA worker thread's arena
t.start()
t.join()
print(main[0], worker[0])
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc settings")
def test_warm_allocator_reuses_freed_memory():
    """The mechanism the benchmarks rely on: as it comes, glibc maps a large block afresh on
    every allocation, in the main thread and in a worker thread (page faults each time it is
    touched); `WARM_ALLOCATOR` reuses it."""
    bq = _bench_qdot()

    def faults(mode, mib):
        env = bq.allocator_env(mode)
        cmd = [sys.executable, "-c", _FAULTS, str(mib)]
        res = subprocess.run(cmd, env=env, capture_output=True)
        assert res.returncode == 0, res.stderr.decode()
        return [int(v) for v in res.stdout.split()]

    for mib in (48, 96):  # below and above the 64 MiB heaps of glibc's thread arenas
        cold, warm = faults("default", mib), faults("warm", mib)
        for c, w in zip(cold, warm):  # the main thread, a worker thread
            assert c >= mib  # 4 allocations of mib MiB: >= 2 * mib faults of 2 MiB huge pages
            assert w * 10 < c


def _hlo_gemms():
    _bench_qdot()  # puts benchmarks/ on sys.path
    import hlo_gemms

    return hlo_gemms


def test_hlo_gemms_cpu(tmp_path):
    """On this backend the compiled layer GEMMs of every INT8 policy read int8 into int32,
    and the float layer's do not (so the check can fail)."""
    hg = _hlo_gemms()
    B, S, H, D = 2, 64, 64, 128
    for name in ("rtne", "s3r", "s3r-ec-2way", "sr"):
        big = hg.layer_gemms(hg.program_gemms(hg.POLICIES[name], B, S, H, D), B, S, H, D)
        assert [g.signature for g in big] == ["s8 x s8 -> s32"] * 3, name
    big = hg.layer_gemms(hg.program_gemms(None, B, S, H, D), B, S, H, D)
    assert len(big) == 3 and all(g.operands != ("s8", "s8") for g in big)
    summary = hg.main(["--shapes", f"{B}x{S}x{H}x{D}", "--out", str(tmp_path)])
    assert summary["meta"]["all_int8"]
    backend = summary["meta"]["backend"]
    assert (tmp_path / f"hlo_gemms_{backend}.md").read_text().startswith("# Compiled GEMMs")


def test_gpu_gemms_runs_every_flag_set(tmp_path):
    """Each XLA flag set in a child process of its own; the page lists every GEMM's kernel
    and the int8/bf16 ratio (on this CPU the numbers mean nothing, the plumbing is checked)."""
    _bench_qdot()
    import gpu_gemms

    s = gpu_gemms.main(
        ["--shapes", "W1", "--tokens", "128", "--repeats", "1", "--calls", "1"]
        + ["--out", str(tmp_path)]
    )
    assert set(s["runs"]) == set(gpu_gemms.FLAG_SETS)
    for run in s["runs"].values():
        assert {(r["gemm"], r["dtype"]) for r in run["rows"]} == {
            (g, d) for g in gpu_gemms.GEMMS for d in gpu_gemms.DTYPES
        }
        assert all(r["median_s"] > 0 for r in run["rows"])
    text = (tmp_path / "gpu_gemms.md").read_text()
    assert "xla_gpu_enable_triton_gemm=false" in text
    assert text.count("| W1 (512, 2048), 128 |") == 6


def test_gpu_kernels_forms_compile_to_the_same_gradients():
    """Every form of the FFN block the GPU benchmark compares gives the same gradients on
    finite inputs (here on the CPU)."""
    _bench_qdot()
    import gpu_kernels
    import jax
    import jax.numpy as jnp
    import jax.random as jr
    import numpy as np

    ffn = gpu_kernels.models.FFN(32, 64, gpu_kernels.PRESETS["s3r"], key=jr.key(0))
    x = jr.normal(jr.key(1), (2, 8, 32), jnp.bfloat16)
    args = (x, x, jr.key(2))
    outs, conditionals = [], {}
    for form in gpu_kernels.FORMS:
        c, a = gpu_kernels.compile_form(ffn, args, form)
        outs.append(c(*a))
        conditionals[form] = (c.as_text() or "").count(" conditional(")
    # the checks are the program's conditionals, and the form without them has none
    assert conditionals["kernel, no checks"] == 0 < conditionals["kernel"]
    for out in outs[1:]:
        for u, v in zip(jax.tree.leaves(out), jax.tree.leaves(outs[0])):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
