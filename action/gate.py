"""Run the gate, ``kvparity run`` on the input's device, from the action's inputs.

The inputs come as environment variables (never spliced into a script). The
exit status is written to ``$GITHUB_OUTPUT`` as ``exit-status`` and this step
exits 0, so the summary and the upload still run after a failing gate; the
action's last step exits with that status.
"""

import os
import shlex
import subprocess
import sys

from kvparity.reports.verdicts import EXIT_USAGE
from workflow_commands import error, record_exit_status


def gate_command(environ) -> list:
    """kvparity run's arguments; optional inputs left empty are left out.
    The Python running this script is the one kvparity was installed into."""
    device = environ.get("KVPARITY_DEVICE", "").strip() or "cpu"
    policy = environ.get("KVPARITY_POLICY", "").strip() or device  # the cpu and gpu policies
    impl = environ.get("KVPARITY_IMPL", "").strip()  # empty: kvparity run reads [tool.kvparity] of pyproject.toml
    command = [sys.executable, "-m", "kvparity", "run", *(["--impl", impl] if impl else []),
               "--level", environ["KVPARITY_LEVELS"], "--device", device, "--policy", policy]
    for option, name in (("--engine", "KVPARITY_ENGINE"), ("--expectations", "KVPARITY_EXPECTATIONS"),
                         ("--shard", "KVPARITY_SHARD"), ("--generated", "KVPARITY_GENERATED")):
        if environ.get(name, "").strip():
            command += [option, environ[name].strip()]
    # Hypothesis's example database, kept between runs by the action (input keep-failures).
    if environ.get("KVPARITY_KEEP_FAILURES", "").strip() == "true" and environ.get("KVPARITY_EXAMPLES"):
        command += ["--generated-database", environ["KVPARITY_EXAMPLES"]]
    return command + ["--out", environ["KVPARITY_OUT"]]


def main() -> int:
    keep = os.environ.get("KVPARITY_KEEP_FAILURES", "true").strip()
    if keep not in ("true", "false"):
        print(error("kvparity gate", f"input keep-failures {keep!r}: expected true or false"))
        record_exit_status(EXIT_USAGE)
        return 0
    command = gate_command(os.environ)
    print("+", shlex.join(command), flush=True)
    status = subprocess.run(command).returncode
    if status == EXIT_USAGE and not os.environ.get("KVPARITY_IMPL", "").strip():
        print(error("kvparity gate", "kvparity run refused its usage (129): with the input impl empty, it reads "
                    "impl from [tool.kvparity] in your pyproject.toml; name your cache there or as the input"))
    record_exit_status(status)
    return 0


if __name__ == "__main__":
    sys.exit(main())
