"""Loading models for training, and `prepare`, which makes a scale's model folder usable.

The `marlflow models` command (also `python -m marlflow models`); its library is `marlflow.models.loading`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from marlflow.models.loading import prepare


def main(argv=None) -> None:
    from marlflow.core.config import SCALES

    ap = argparse.ArgumentParser(prog="marlflow models", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    toy = sub.add_parser("build-toy", help="build and warm-start the toy model (no READY)")
    prep = sub.add_parser("prepare", help="make DIR usable as the model of a scale; writes DIR/READY last")
    prep.add_argument("--scale", required=True, choices=SCALES)
    prep.add_argument("--model", required=True, help="toy: ignored; smol: ignored; others: hub id or folder")
    prep.add_argument(
        "--build",
        action="store_true",
        help="toy: build the model here even when the settings are the shipped model's",
    )
    from marlflow.models import toybuild

    for p in (toy, prep):
        p.add_argument("--out", required=True, type=Path)
        toybuild.add_arguments(p)  # the toy build's options; other scales ignore them
    args = ap.parse_args(argv)
    settings = {k: getattr(args, k) for k in ("steps", "solve_steps", "batch_size", "lr", "threads", "bf16")}
    if args.cmd == "build-toy":
        info = toybuild.build_toy(args.out, seed=args.seed, eval_n=args.eval_n, **settings)
    else:
        info = prepare(
            args.scale, args.model, args.out, seed=args.seed, eval_n=args.eval_n, build=args.build, **settings
        )
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
