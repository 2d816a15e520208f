"""Command-line plumbing that the unit tests of the library do not reach."""

from wide.cli import build_parser, demo_args


def test_demo_has_every_option_calibrate_and_eval_read():
    parser = build_parser()
    args = demo_args(parser.parse_args(["demo", "--steps", "6", "--out", "runs/x"]))
    needed = set(vars(parser.parse_args(["calibrate", "--out", "x"]))) | set(vars(parser.parse_args(["eval"])))
    assert needed <= set(vars(args))
    assert args.steps == 6 and args.limit == 20 and args.batch_size == 4  # the demo's own values win
    assert args.resume and args.dense and args.eval_every == 3 and args.target == 0.5
