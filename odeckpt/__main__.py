"""`python -m odeckpt demo [--tiny] [--output PATH]`."""

import argparse
from pathlib import Path

from ._demo import main as demo


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m odeckpt")
    commands = parser.add_subparsers(dest="command", required=True)
    parser_demo = commands.add_parser(
        "demo",
        help="solve a problem, take its gradient with every adjoint, print time and memory, "
        "and plot the trajectory and memory against checkpoints",
    )
    parser_demo.add_argument(
        "--tiny", action="store_true", help="a few seconds' version (for tests)"
    )
    parser_demo.add_argument(
        "--output", type=Path, default=Path("odeckpt-demo.png"), help="where to write the PNG"
    )
    arguments = parser.parse_args()
    demo("tiny" if arguments.tiny else "full", arguments.output)


if __name__ == "__main__":
    main()
