"""--help that shows each flag's default once.

Some flags say their default in their own words ("default: the model folder"), BooleanOptionalAction adds
one itself, and argparse.ArgumentDefaultsHelpFormatter appended "(default: ...)" to all of them again; this
formatter adds it only to flags whose help does not mention a default yet, and not for None/False."""

from __future__ import annotations

import argparse


class DefaultsOnceFormatter(argparse.HelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text.lower() or not action.option_strings  # 0 is a default worth showing, False is not
                or action.default is None or action.default is False or action.default == argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"
