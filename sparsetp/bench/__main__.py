"""``python -m sparsetp.bench attention|tp [--flags]`` (``--helpfull`` lists every flag)."""

from __future__ import annotations

import importlib
import sys

_COMMANDS = ("attention", "tp")


def main(argv=None) -> None:
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] not in _COMMANDS:
        sys.exit(f"usage: python -m sparsetp.bench {{{'|'.join(_COMMANDS)}}} [--flags]; "
                 f"got {argv[1:]}")
    # Only the chosen command's module is imported, so only its flags are defined.
    command = importlib.import_module(f"sparsetp.bench.{argv[1]}")
    command.main([argv[0]] + argv[2:])


if __name__ == "__main__":
    main()
