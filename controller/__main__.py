"""``python -m controller --config F [--table NAME] [--host H] [--port P]``."""

from __future__ import annotations

import argparse
import logging
import sys

from controller.cli import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, set up logging, run the controller; return the exit status."""
    parser = argparse.ArgumentParser(prog="python -m controller", description=__doc__)
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
