"""Regenerate the quoted outputs of `docs/guides/training.md` (no number there is typed by hand).

Runs the guide's commands on this machine, in a scratch folder:

1. `s3req train` with the defaults (the guide's section 2): the header, the summary lines and
   the validation losses;
2. `s3req sample` from that run (section 3, temperature 0.8, seed 0);
3. `s3req compare --policies bf16,rtne,sr,s3r,s3r-ec-2way --steps 60 --eval-every 20
   --warmup 10` (section 5): the table.

and rewrites the blocks of the guide between `<!-- generated:NAME -->` and
`<!-- /generated:NAME -->` markers (the text around them is kept).

    python experiments/training_guide.py            # ~15 min on 2 shared CPU cores
    python experiments/training_guide.py --smoke    # a few steps, writes to --guide only if given
"""

import argparse
import contextlib
import io
import json
import pathlib
import re
import sys
import tempfile
import time


ROOT = pathlib.Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "guides" / "training.md"


def _run(argv: list[str]) -> tuple[int, str, str]:
    from s3req.train import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, out.getvalue(), err.getvalue()


def replace_block(text: str, name: str, body: str) -> str:
    """`text` with the block between the markers of `name` replaced by `body`."""
    start, end = f"<!-- generated:{name} -->", f"<!-- /generated:{name} -->"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), flags=re.S)
    if not pattern.search(text):
        raise ValueError(f"{GUIDE.name}: no {start} ... {end} block")
    return pattern.sub(lambda _: f"{start}\n{body.strip()}\n{end}", text)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="4 steps of everything")
    ap.add_argument("--guide", default=None, help=f"the page to rewrite (default: {GUIDE})")
    args = ap.parse_args(argv)
    guide = pathlib.Path(args.guide) if args.guide else (None if args.smoke else GUIDE)
    steps = ["--steps", "4", "--eval-every", "2", "--eval-batches", "1"] if args.smoke else []
    cmp_steps = ["--steps", "4", "--eval-every", "2"] if args.smoke else ["--steps", "60"]
    with tempfile.TemporaryDirectory() as tmp:
        run = pathlib.Path(tmp) / "runs" / "tiny-s3r-ec-2way"
        t0 = time.perf_counter()
        status, out, err = _run(["train", "--out", str(run), *steps])
        assert status == 0, err
        wall = time.perf_counter() - t0
        header = [
            line
            for line in err.splitlines()
            if line[:8].strip() in ("model", "data", "plan", "out")
        ]
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        vals = [r["val_loss"] for r in records if "val_loss" in r]
        hint = out.split("--prompt ", 1)[1].strip()
        status, sample_out, err = _run(
            ["sample", "--ckpt", str(run), "--prompt", hint.strip("'\""), "--tokens", "160"]
        )
        assert status == 0, err
        status, cmp_out, err = _run(
            ["compare", "--policies", "bf16,rtne,sr,s3r,s3r-ec-2way", *cmp_steps,
             "--eval-every", "20", "--warmup", "10", "--out", str(pathlib.Path(tmp) / "cmp"),
             "--quiet"]
        )  # fmt: skip
        assert status == 0, err
    shown_out = out.replace(str(run), "runs/tiny-s3r-ec-2way")
    table = "\n".join(line for line in cmp_out.splitlines() if line.startswith("|"))
    result = {
        "train_wall_s": wall,
        "val_loss_start": vals[0],
        "val_loss_final": vals[-1],
        "header": header,
        "summary": shown_out,
        "sample": sample_out,
        "compare_table": table,
    }
    if guide is not None:
        text = guide.read_text()
        text = replace_block(
            text,
            "train-losses",
            f"the validation loss fell from **{vals[0]:.2f} to {vals[-1]:.2f}** nats/token in "
            f"{wall / 60:.0f} min",
        )
        text = replace_block(
            text,
            "train-output",
            "```text\n$ s3req train\n"
            + "\n".join(header).replace(str(run), "runs/tiny-s3r-ec-2way")
            + "\ncompiling the training step ... done in (seconds)\n"
            + "(progress bar: step, loss, val, tok/s)\n"
            + shown_out.strip()
            + "\n```",
        )
        text = replace_block(text, "sample-output", "```text\n" + sample_out.strip() + "\n```")
        text = replace_block(text, "compare-table", table)
        guide.write_text(text)
        print(f"rewrote {guide}", file=sys.stderr)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
