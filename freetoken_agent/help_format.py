"""The help formatter of the command line's parsers (`freetoken CMD --help`, and every
benchmark's, as `freetoken bench`'s list promises): each option's help states its default, so
a help text never writes it by hand (one that already says "(default ...)" is left as it is:
`serve --api-key`'s default is a secret read from the environment).

Descriptions stay as written (the module docstrings are wrapped by hand and hold usage blocks).
A default of None or False means "not given" and is left out: such an option's help says what
happens then. A list's default is shown as it is typed (`--batches 1 4`), an empty one as none.
"""

from __future__ import annotations

import argparse
import textwrap


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    def _split_lines(self, text: str, width: int) -> list[str]:
        # argparse wraps at hyphens too, which splits option names (--no-overlap), policy
        # names (gpu-fill) and default paths across lines.
        # Nor within a word longer than the width (a default path under a long folder).
        return textwrap.wrap(
            " ".join(text.split()), width, break_on_hyphens=False, break_long_words=False
        )

    def _get_help_string(self, action: argparse.Action) -> str:
        # The hook argparse.ArgumentDefaultsHelpFormatter overrides; it would print None, False
        # and a list's brackets, so the default is written here instead.
        text = action.help or ""
        default = action.default
        if (
            "%(default)" in text
            or "(default" in text.lower()  # said by hand: `serve --api-key`'s, an env secret
            or not action.option_strings
            or default is None
            or default is False
            or default is argparse.SUPPRESS
        ):
            return text
        if isinstance(default, (list, tuple)):
            shown = " ".join(map(str, default)) if default else "none"
        else:
            shown = str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"  # argparse %-formats the help
