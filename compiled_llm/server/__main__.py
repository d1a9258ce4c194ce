"""python -m compiled_llm.server [flags]: the same as `python -m compiled_llm serve`."""

import argparse
import sys

from compiled_llm.help_format import DefaultsOnceFormatter
from compiled_llm.server.cli import DESCRIPTION, add_serve_args, run_server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m compiled_llm.server", description=DESCRIPTION,
                                     formatter_class=DefaultsOnceFormatter)
    add_serve_args(parser)
    return run_server(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
