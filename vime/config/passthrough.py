"""Collect prefixed flags (``--vllm-*``, ``--router-*``) that vime forwards to another program."""

from __future__ import annotations


def split_prefixed(argv: list[str], prefix: str, keep: set[str]) -> tuple[dict[str, str | None], list[str]]:
    """Take ``--<prefix><name> [value]`` tokens out of ``argv``.

    Returns ({name: value or None for a bare switch}, the remaining argv). Flags named in ``keep``
    belong to vime itself and stay in the remainder. A value is the next token unless it starts
    with ``--``; ``--flag=value`` is also accepted.
    """
    forwarded: dict[str, str | None] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0]
        if token.startswith("--" + prefix) and name not in keep:
            key = name[len("--" + prefix) :]
            if "=" in token:
                forwarded[key] = token.split("=", 1)[1]
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                forwarded[key] = argv[i + 1]
                i += 1
            else:
                forwarded[key] = None
        else:
            rest.append(token)
        i += 1
    return forwarded, rest


def to_cli(forwarded: dict[str, str | None]) -> list[str]:
    out: list[str] = []
    for key, value in forwarded.items():
        out.append("--" + key)
        if value is not None:
            out.append(value)
    return out
