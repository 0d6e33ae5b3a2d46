"""GitHub workflow commands (``::error ...::message``) printed safely.

A message is one line whatever it holds: ``%``, CR and LF are escaped, so a
test's output cannot end the command early or start another one. Property
values (``title=``) escape ``:`` and ``,`` too. The action's exit status
goes to ``$GITHUB_OUTPUT`` the same way from every script.
"""

import os


def escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def record_exit_status(status: int):
    """The action's ``exit-status`` output, in ``$GITHUB_OUTPUT`` (nothing outside a workflow)."""
    if os.environ.get("GITHUB_OUTPUT"):
        with open(os.environ["GITHUB_OUTPUT"], "a", encoding="utf-8") as output:
            output.write(f"exit-status={status}\n")


def error(title: str, message: str) -> str:
    return f"::error title={escape_property(title)}::{escape_data(message)}"
