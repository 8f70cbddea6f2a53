"""Command-line plumbing shared by every script: bad input becomes one line on stderr, not a traceback."""
import sys
from typing import Callable


class CLIError(Exception):
    """A problem with the user's input or files; printed as `error: <message>` with exit status 1."""


def run(main: Callable[[], None]) -> None:
    """Run a script's main(); user-facing errors (CLIError, ValueError, OSError) print one line and exit 1."""
    try:
        main()
    except (CLIError, ValueError, OSError) as e:
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {message}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
