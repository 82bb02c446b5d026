"""Write the paper-versus-ours summary of `docs/results/index.md` from the results JSON files.

Reads `table1_<scale>.json`, `table2.json`, `table2_width.json`, `table3_ffn_speed.json`,
`table4_full_step.json`, `tpu_compile.json`, `tpu_table4.json`, `theory.json`,
`hf_load_memory.json` and `peers.json` from `--dir` and replaces the block between the markers
`<!-- paper-vs-ours:start -->` and `<!-- paper-vs-ours:end -->` of `index.md` (appended when
the markers are missing); the rest of the page is kept. A table whose JSON is missing is
listed as not generated.

    python experiments/results_index.py                     # after the scripts below ran
    python experiments/results_index.py --dir /tmp/r        # smoke test
"""

import argparse
import json
import math
import pathlib


ROOT = pathlib.Path(__file__).resolve().parent.parent
START, END = "<!-- paper-vs-ours:start -->", "<!-- paper-vs-ours:end -->"


def _load(d: pathlib.Path, name: str):
    p = d / name
    return json.loads(p.read_text()) if p.is_file() else None


def _f(x, spec=".3f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) and math.isfinite(x) else "n/a"


def table1(d: pathlib.Path) -> list[str]:
    import table1_quality as t1

    for scale in ("cpu", "quick"):
        s = _load(d, f"table1_{scale}.json")
        if s is not None:
            break
    else:
        return ["Table I: not generated yet (`python experiments/table1_quality.py`)."]
    rows = s["rows"]
    seeds = f" --seeds {s['seeds_override']}" if s.get("seeds_override") is not None else ""
    out = [
        f"### Table I: model quality ([page](table1_{scale}.md), `{scale}` scale)",
        "",
        f"`python experiments/table1_quality.py --scale {scale}{seeds}`"
        + (" (full CPU table: `--scale cpu`, a few hours)" if scale != "cpu" else "")
        + f". Final validation loss minus BF16's, mean over {len(s['settings']['seeds'])} seeds "
        "(+- the standard error of the difference); the paper's 12-layer C4 model beside it. "
        "Absolute losses are not comparable (other model, data and length): compare the signs "
        "and orderings.",
        "",
        "| configuration | paper: gap to BF16 | ours: gap to BF16 | paper: Welch t vs SR "
        "| ours: Welch t vs SR |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    paper_sr = t1.PAPER["sr"]
    bf = rows.get("bf16")
    for config, r in rows.items():
        p = t1.PAPER[config]
        pgap = p[1] - t1.PAPER["bf16"][1]
        if config == "sr":
            pt = "—"
        else:
            pt = _f((p[1] - paper_sr[1]) / math.sqrt((p[2] ** 2 + paper_sr[2] ** 2) / 3), "+.1f")
        if bf is not None and config != "bf16":
            n = len(r["val_losses"])
            se = math.sqrt((r["std"] ** 2 + bf["std"] ** 2) / n) if n > 1 else float("nan")
            ours = f"{r['gap_bf16']:+.3f} +- {_f(se)}"
        else:
            ours = "—"
        t = r.get("welch_t_vs_sr")
        out.append(
            f"| {r['label']} | {'—' if config == 'bf16' else f'{pgap:+.3f}'} | {ours} | {pt} "
            f"| {'—' if t is None else _f(t, '+.1f')} |"
        )
    out += [
        "",
        "Orderings of the paper at this scale (verdict of the paired t over seeds, two-sided "
        "5%; Welch's t beside it):",
        "",
    ]
    for c in s["claims"]:
        out.append(
            f"- {c['claim']}: {c['verdict']} (paired t = "
            f"{_f(c.get('paired_t', float('nan')), '+.1f')}, p = "
            f"{_f(c.get('paired_p', float('nan')))}; Welch t = {_f(c['t'], '+.1f')})"
        )
    return out


def table2(d: pathlib.Path) -> list[str]:
    s = _load(d, "table2.json")
    if s is None:
        return ["Table II: not generated yet (`python experiments/table2_gradient_error.py`)."]
    out = [
        "### Table II: gradient error ([page](table2.md))",
        "",
        "`python experiments/table2_gradient_error.py`. Relative error against the float "
        "gradient, paper / ours (ours: 4-layer width-128 model, so every error is smaller; "
        "compare the orderings within a column).",
        "",
        "| configuration | dX layer 0 | dX top layer | dW layer 0 | Emb. |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for label, r in s["rows"].items():
        paper = r["paper"] or [None] * 4
        cells = [f"{_f(p)} / {m:.3f}" for p, m in zip(paper, r["mean"])]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out


def table2_width(d: pathlib.Path) -> list[str]:
    s = _load(d, "table2_width.json")
    if s is None:
        return [
            "Table II across widths: not generated yet (`python experiments/table2_width.py`)."
        ]
    out = [
        "### Table II across widths ([page](table2_width.md))",
        "",
        "`python experiments/table2_width.py`. The S3R (Phi2D) / Independent SR ratio of the "
        "layer-0 dX error on 2-layer Llamas of growing width (paper, 12-layer model: "
        f"{0.877 / 0.572:.2f}), beside Proposition 1's prediction from each checkpoint's W.",
        "",
        "| width | Phi2D / SR (total) | Phi2D / SR (noise) | Prop. 1 (rms over GEMMs) "
        "| isolated GEMM: measured / Prop. 1 | EC two-way / SR |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for w in s["widths"]:
        r = w["ratios_vs_sr"]
        g = w["gemm"].values()
        gm = sum(v["ratio"] for v in g) / len(g)
        gp = sum(v["predicted"] for v in g) / len(g)
        out.append(
            f"| {w['width']} | {r['s3r']['total'][0]:.3f} | {r['s3r']['noise'][0]:.3f} "
            f"| {w['predicted_ratio_mean']:.3f} | {gm:.3f} / {gp:.3f} "
            f"| {r['s3r-ec-2way']['total'][0]:.3f} |"
        )
    return out


def table3(d: pathlib.Path) -> list[str]:
    import table3_ffn_speed as t3

    s = _load(d, "table3_ffn_speed.json")
    if s is None:
        return ["Table III: not generated yet (`python experiments/table3_ffn_speed.py`)."]
    out = [
        "### Table III: FFN block ([page](table3_ffn_speed.md), CPU)",
        "",
        "`python experiments/table3_ffn_speed.py` (exact shapes on a GPU: `--full`). Time "
        "ratios between INT8 policies, paper (TPU v5p) / ours (CPU, shared machine, "
        "a few % is noise; * = reduced H).",
        "",
        "| shape | S3R / RTNE | Indep. SR / S3R | S3R-EC two-way over S3R "
        "| S3R-EC dX-only over S3R |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in s["rows"]:
        t, p = r["median_s"], t3.PAPER[r["name"]]
        star = "*" if r["scaled"] else ""
        out.append(
            f"| {r['name']}{star} | {p[0] / p[2]:.3f} / {t['s3r'] / t['rtne']:.3f} "
            f"| {p[2] / p[1]:.2f} / {t['sr'] / t['s3r']:.2f} "
            f"| {p[3]:+.1f}% / {100 * (t['s3r-ec-2way'] / t['s3r'] - 1):+.1f}% "
            f"| {p[4]:+.1f}% / {100 * (t['s3r-ec-dx'] / t['s3r'] - 1):+.1f}% |"
        )
    return out


def table4(d: pathlib.Path) -> list[str]:
    import table4_full_step as t4

    s = _load(d, "table4_full_step.json")
    if s is None:
        return ["Table IV: not generated yet (`python experiments/table4_full_step.py`)."]
    names = list(s["speed"])
    out = [
        "### Table IV: full step and memory ([page](table4_full_step.md))",
        "",
        "`python experiments/table4_full_step.py`. Speedup over Independent SR, paper "
        "(Llama 3.1-8B / Qwen3-8B / Qwen3-30B-A3B / DeepSeek-V2-Lite on TPU v5p) and ours "
        f"({' / '.join(names)} on the CPU).",
        "",
        "| configuration | paper | ours |",
        "| --- | --- | --- |",
    ]
    for p in ("s3r", "s3r-ec-2way", "s3r-ec-dx"):
        paper = " / ".join(f"{t4.PAPER_VS_SR[m][p]:.3f}" for m in t4.PAPER_VS_SR)
        ours = " / ".join(
            f"{s['speed'][n]['median_s']['sr'] / s['speed'][n]['median_s'][p]:.3f}" for n in names
        )
        out.append(f"| {t4.LABELS[p]} | {paper} | {ours} |")
    if s["memory"]:
        out += [
            "",
            "Compile-time device memory minus INT8 RTNE's (MiB; ours: 2-layer cuts of the "
            "presets, 1 x 4096 tokens; paper: S3R +0 on dense models, +0.4-0.7 GB on MoE; "
            "S3R-EC two-way at most +0.4 GB):",
            "",
            "| model | S3R | S3R-EC two-way | S3R-EC dX-only | Indep. SR |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for name, m in s["memory"].items():
            P = m["policies"]
            base = P["rtne"]["total_bytes"]
            cells = [
                f"{(P[p]['total_bytes'] - base) / 2**20:+.1f}" if p in P else "n/a"
                for p in ("s3r", "s3r-ec-2way", "s3r-ec-dx", "sr")
            ]
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def theory(d: pathlib.Path) -> list[str]:
    s = _load(d, "theory.json")
    if s is None:
        return ["Theory: not generated yet (`python experiments/theory.py`)."]
    l2, b = s["lemma2"], s["bias"]
    layers = s["theorem1"]["layers"]
    iid = next(iter(layers.values()))
    fr = [v["fraction_noisier_after_centering"] for v in layers.values()]
    return [
        "### Theory ([page](theory.md))",
        "",
        "`python experiments/theory.py`.",
        "",
        "| quantity | paper | ours |",
        "| --- | --- | --- |",
        f"| variance of a shared-threshold error, even residuals | delta^2/6 = 0.1667 "
        f"| {l2['mean_variance']:.4f} (exact) |",
        f"| pair covariance, even residuals | delta^2/12 = 0.0833 "
        f"| {l2['mean_pair_covariance']:.4f} (exact) |",
        f"| max bias of 7-bit half-step thresholds | <= delta/256 = 0.00391 "
        f"| {b['max_abs_bias']:.5f} (exact) |",
        f"| dX outputs noisier after centering (synthetic layer) | 17-27% "
        f"| {iid['fraction_noisier_after_centering']:.0%} (i.i.d. weights); "
        f"{min(fr):.0%}-{max(fr):.0%} over all layers |",
        f"| fall of the summed dX variance | 40-63% | {iid['summed_variance_fall']:.0%} "
        "(i.i.d. weights) |",
        f"| centered variance vs independent SR | below | "
        f"{iid['summed_var_ec_over_independent']:.2f}x (i.i.d. weights) |",
    ]


def hf_memory(d: pathlib.Path) -> list[str]:
    s = _load(d, "hf_load_memory.json")
    if s is None:
        return ["HF loading memory: not generated yet (`python experiments/hf_load_memory.py`)."]
    e = s["estimate_8b"]
    return [
        "### Loading a Hugging Face checkpoint ([page](hf_load_memory.md))",
        "",
        f"`python experiments/hf_load_memory.py`. Peak host memory of `load_hf` on the "
        f"{s['checkpoint_bytes'] / 1e9:.2f} GB bfloat16 checkpoint of `{s['preset']}`: "
        f"{e['float32']['peak'] / 1e9:.2f} GB as float32 parameters "
        f"({e['float32']['params'] / 1e9:.2f} GB of them), "
        f"{e['bfloat16']['peak'] / 1e9:.2f} GB as bfloat16 ones.",
    ]


def tpu(d: pathlib.Path) -> list[str]:
    c, t4 = _load(d, "tpu_compile.json"), _load(d, "tpu_table4.json")
    if c is None and t4 is None:
        return ["TPU v5p compile: not generated yet (`python benchmarks/tpu_compile.py`)."]
    out = [
        "### TPU v5p compile: memory and program structure ([Table III shapes](tpu_compile.md), "
        "[Table IV step](tpu_table4.md))",
        "",
        "`python benchmarks/tpu_compile.py`: compiled for v5p 2x2x1 on a CPU machine with "
        "libtpu (no TPU ran; memory is XLA's compile-time analysis per chip, the paper's "
        "Table IV method). Ranges over the compiled FFN shapes (W1..W9) and, for the full "
        "step, over the dense models (the depth of each step in brackets).",
        "",
        "| claim | paper | ours |",
        "| --- | --- | --- |",
    ]

    def span(v: list[float], spec: str, unit: str = "") -> str:
        return f"{format(min(v), spec)}{unit} to {format(max(v), spec)}{unit}" if v else "n/a"

    rows = [r["policies"] for r in (c or {}).get("ffn", {}).values() if r.get("policies")]
    temp = lambda P, p: P[p]["memory"]["temporaries"]
    over = lambda a, b: [100 * (temp(P, a) / temp(P, b) - 1) for P in rows if a in P and b in P]

    def over_on(field: str, a: str, b: str) -> list[float]:
        mem = lambda P, p: P[p]["memory"].get(field)
        pairs = [(mem(P, a), mem(P, b)) for P in rows if a in P and b in P]
        return [100 * (x / y - 1) for x, y in pairs if x and y]

    ops = lambda a: [
        P[a]["vector_ops_per_upstream_element"] - P["rtne"]["vector_ops_per_upstream_element"]
        for P in rows
        if a in P and "rtne" in P
    ]
    out += [
        f"| S3R temporaries over RTNE, FFN block | 0 | {span(over('s3r', 'rtne'), '+.1f', '%')} |",
        "| S3R-EC dX-only temporaries over S3R, FFN block | +8 to +14% (both variants) "
        f"| {span(over('s3r-ec-dx', 's3r'), '+.1f', '%')} |",
        "| S3R-EC two-way temporaries over S3R, FFN block | +8 to +14% (both variants) "
        f"| {span(over('s3r-ec-2way', 's3r'), '+.1f', '%')} |",
        "| ... on XLA's peak: S3R over RTNE | 0 "
        f"| {span(over_on('peak', 's3r', 'rtne'), '+.1f', '%')} |",
        "| ... on XLA's peak: dX-only / two-way over S3R (temporaries count the packing's "
        "holes twice, [packing page](tpu_packing.md)) | +8 to +14% "
        f"| {span(over_on('peak', 's3r-ec-dx', 's3r'), '+.1f', '%')} / "
        f"{span(over_on('peak', 's3r-ec-2way', 's3r'), '+.1f', '%')} |",
        "| vector ops per gradient element over RTNE: Independent SR | +120 to +133 (from time) "
        f"| {span(ops('sr'), '+.0f')} (static HLO count) |",
        f"| ... S3R | -2 to +6 | {span(ops('s3r'), '+.1f')} |",
        f"| ... S3R-EC two-way / dX-only | +15 to +23 | {span(ops('s3r-ec-2way'), '+.1f')} / "
        f"{span(ops('s3r-ec-dx'), '+.1f')} |",
    ]
    dense = [
        m["policies"]
        for n, m in (t4 or {}).get("models", {}).items()
        if n in ("Llama 3.1-8B", "Qwen3-8B")
    ]
    mem = lambda P, p, key: P[p]["memory"].get(key)
    diff = lambda a, b, key="total": [
        (mem(P, a, key) - mem(P, b, key)) / 1e9
        for P in dense
        if a in P and b in P and mem(P, a, key) is not None and mem(P, b, key) is not None
    ]
    commits = lambda Ps: ", ".join(sorted({r.get("commit", "?") for P in Ps for r in P.values()}))
    out[2] += f" Engine commits: FFN rows {commits(rows) or 'none'}; full-step rows " + (
        commits([m["policies"] for m in (t4 or {}).get("models", {}).values()]) or "none"
    )
    out[2] += " (each page names the commit of every row)."
    import models

    def depth(names: tuple[str, ...]) -> str:
        ms = [m for n, m in (t4 or {}).get("models", {}).items() if n in names]
        full = [m["n_layers"] == models.get_config(m["preset"]).n_layers for m in ms]
        return "full models" if full and all(full) else "layer cut"

    dense_names = ("Llama 3.1-8B", "Qwen3-8B")
    out += [
        f"| full step, dense: S3R - RTNE (GB) | 0 | {span(diff('s3r', 'rtne'), '+.3f')} |",
        "| full step, dense: S3R-EC two-way - S3R (GB) | at most +0.4 "
        f"| {span(diff('s3r-ec-2way', 's3r'), '+.3f')} ({depth(dense_names)}) |",
        "| ... on XLA's peak | at most +0.4 "
        f"| {span(diff('s3r-ec-2way', 's3r', 'peak'), '+.3f')} ({depth(dense_names)}) |",
    ]
    moe = [
        (n, m["policies"])
        for n, m in (t4 or {}).get("models", {}).items()
        if n not in ("Llama 3.1-8B", "Qwen3-8B")
    ]
    each = lambda rows, a, b, key="total": (
        ", ".join(
            f"{(mem(P, a, key) - mem(P, b, key)) / 1e9:+.3f} ({n})"
            for n, P in rows
            if a in P and b in P and mem(P, a, key) is not None and mem(P, b, key) is not None
        )
        or "n/a"
    )
    paper_moe = "+0.4 (Qwen3-30B-A3B), +0.7 (DeepSeek-V2-Lite)"
    if moe:
        cut = depth(tuple(n for n, _ in moe))
        out += [
            f"| full step, MoE: S3R - RTNE (GB) | {paper_moe} | {each(moe, 's3r', 'rtne')} "
            f"({cut}) |",
            "| full step, MoE: S3R-EC two-way - S3R (GB) | not given "
            f"| {each(moe, 's3r-ec-2way', 's3r')} ({cut}) |",
            "| ... on XLA's peak | not given "
            f"| {each(moe, 's3r-ec-2way', 's3r', 'peak')} ({cut}) |",
        ]
    # Every model at its real depth, with fewer sequences per chip (`--parts full`): the
    # dense rows there are the like-for-like scale of the MoE rows' EC surplus.
    here = (t4 or {}).get("meta", {}).get("topology")
    deep = [
        (n + (f" on {m['topology']}" if m.get("topology", here) != here else ""), m["policies"])
        for n, m in (t4 or {}).get("full_depth", {}).items()
    ]
    deep = [(n, P) for n, P in deep if P]
    if deep:
        per_chip = next(iter((t4 or {})["full_depth"].values()))["per_chip"]
        at = f"real depth, {per_chip} sequence(s) per chip"
        out += [
            f"| full step ({at}): S3R - RTNE (GB) | 0 (dense), {paper_moe} "
            f"| {each(deep, 's3r', 'rtne')} |",
            f"| full step ({at}): S3R-EC two-way - S3R (GB) | at most +0.4 (dense), not given "
            f"(MoE) | {each(deep, 's3r-ec-2way', 's3r')} |",
            f"| ... on XLA's peak | at most +0.4 (dense), not given (MoE) "
            f"| {each(deep, 's3r-ec-2way', 's3r', 'peak')} |",
        ]
    return out


def peers(d: pathlib.Path) -> list[str]:
    s = _load(d, "peers.json")
    if s is None:
        return ["Peers: not generated yet (`python benchmarks/peers.py`)."]
    t = {n: r["median_s"] for n, r in s["speed"]["ratio_to_rtne"].items()}
    q = next(q for q in s["quality"] if q["weight"] == "shared")
    shared = q["rows"]
    B, S, H, D = s["speed"]["shape"]
    b, n_tok, h, d = q["shape"]
    return [
        "### The peers: AQT and Qwix ([page](peers.md))",
        "",
        f"`{s['meta']['command']}`. The same layer side by side on the CPU: time over s3req "
        f"INT8 RTNE (x {B}x{S}x{H} @ w {H}x{D}), and the dX error against the float gradient "
        f"with a weight whose rows share a component (x {b}x{n_tok}x{h} @ w {h}x{d}, mean over "
        f"{q['keys']} keys).",
        "",
        "| method | time / s3req RTNE | dX error, shared rows |",
        "| --- | ---: | ---: |",
        *(
            f"| {n} | {t[n]:.2f} | {shared[n]['dx']['error_vs_float']:.3f} |"
            for n in ("rtne", "s3r", "s3r-ec-2way", "aqt-rtne", "aqt-sr", "qwix-rtne", "qwix-sr")
        ),
    ]


def render(d: pathlib.Path) -> str:
    parts = [
        START,
        "",
        "## The paper beside ours",
        "",
        "Written by `python experiments/results_index.py` from the JSON files of the pages "
        "below; each table names the command that regenerates it.",
        "",
    ]
    for fn in (table1, table2, table2_width, table3, table4, tpu, theory, hf_memory, peers):
        parts += fn(d) + [""]
    parts.append(END)
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> str:
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--dir", default=str(ROOT / "docs" / "results"))
    args = ap.parse_args(argv)
    d = pathlib.Path(args.dir)
    index = d / "index.md"
    text = index.read_text() if index.is_file() else "# Results\n"
    block = render(d)
    if START in text and END in text:
        head, rest = text.split(START, 1)
        tail = rest.split(END, 1)[1].lstrip("\n")
        text = head + block + ("\n" + tail if tail else "")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    index.write_text(text)
    return text


if __name__ == "__main__":
    main()
