"""GPU check, end-to-end step (c): ``retromae-ds eval`` of all-MiniLM-L6-v2 on SciFact test on
the device and the same command on the CPU, side by side.

Both read one collection: SciFact's test queries over every abstract they judge plus a fixed
sample of the others (the CPU's pass over the whole 5,183-abstract corpus would not fit the
step's time limit on the device machine), at one ``--max_length``. Passes when both nDCG@10
are present and plausible for MiniLM (above ``floor``) and differ by at most ``tol`` (0.01:
a rank swap or two between float paths; tests/test_eval.py holds bf16 autocast to the same).

    python scripts/gpu_e2e/eval_parity.py --device cuda --work /tmp/w --results results/
"""

from __future__ import annotations

import argparse
import json
import sys

from harness import CheckFailed, Runner, beir_slice, cli, main, minilm, scifact

# cpu: 10 test queries over their abstracts and 100 others (smoke: both runs on the CPU);
# cuda: all 300 test queries over their abstracts and 1,000 others
SIZES = {
    "cpu": dict(test_queries=10, extra_docs=100, max_length=64),
    "cuda": dict(test_queries=None, extra_docs=1000, max_length=128),
}
TOL = 0.01
FLOOR = 0.3
"""MiniLM scores 0.645 nDCG@10 on the whole of SciFact test; far below means a broken path."""


def step(args: argparse.Namespace, runner: Runner) -> tuple[str, dict]:
    size = SIZES[args.device]
    work = runner.work
    beir = beir_slice(
        scifact(), work / "scifact", splits={"test": size["test_queries"]},
        extra_docs=size["extra_docs"],
    )  # fmt: skip
    model = str(minilm())
    # "device" is the device under test, "cpu" the reference; in the CPU smoke mode both are
    # the CPU, so CI runs the same two commands and the same comparison
    devices = {"device": args.device, "cpu": "cpu"}
    out = {arm: work / f"eval_{arm}.json" for arm in devices}
    # one process per arm, at once: the device's run barely uses the CPU the other needs
    for arm, device in devices.items():
        runner.start(
            f"eval_{arm}",
            cli(
                "eval", "--model", model, "--beir", str(beir), "--split", "test",
                "--max_length", str(size["max_length"]), "--device", device,
                "--out", str(out[arm]), "--progress", "false",
            ),
        )  # fmt: skip
    for arm in devices:
        runner.wait(f"eval_{arm}")
    results = {arm: json.loads(path.read_text()) for arm, path in out.items()}
    ndcg = {arm: r["metrics"]["ndcg@10"] for arm, r in results.items()}
    diff = abs(ndcg["device"] - ndcg["cpu"])
    first = results["cpu"]
    figures = {
        "sizes": size,
        "num_corpus": first["num_corpus"],
        "num_queries": first["num_queries"],
        "ndcg@10": ndcg,
        "devices": devices,
        "metrics": {arm: r["metrics"] for arm, r in results.items()},
        "abs_diff": diff,
        "tol": TOL,
        "eval_seconds": {arm: r["seconds"] for arm, r in results.items()},
    }
    verdict = (
        f"nDCG@10 {args.device} {ndcg['device']:.4f} vs cpu {ndcg['cpu']:.4f}, |diff| "
        f"{diff:.4f} (tolerance {TOL}); {first['num_queries']} queries, "
        f"{first['num_corpus']} abstracts, max length {size['max_length']}"
    )
    ran_on = {arm: r["settings"].get("device") for arm, r in results.items()}
    figures["ran_on"] = ran_on
    if not all(str(ran_on[arm]).startswith(devices[arm]) for arm in devices):
        raise CheckFailed(f"the encoders ran on {ran_on}, not {devices}", figures)
    if min(ndcg.values()) < FLOOR:
        raise CheckFailed(f"nDCG@10 below {FLOOR} for MiniLM: {verdict}", figures)
    if diff > TOL:
        raise CheckFailed(verdict, figures)
    return verdict, figures


if __name__ == "__main__":
    sys.exit(main("eval", step))
