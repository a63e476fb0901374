"""Collect prefixed flags (``--vllm-*``, ``--router-*``) that vime forwards to another program."""

from __future__ import annotations

# A forwarded flag's value: None for a bare switch, a string for one value, a list for several
# (``--vllm-cudagraph-capture-sizes 1 2 4 8``, an ``nargs='+'`` flag of vLLM's).
Forwarded = str | list[str] | None


def split_prefixed(argv: list[str], prefix: str, keep: set[str]) -> tuple[dict[str, Forwarded], list[str]]:
    """Take ``--<prefix><name> [value ...]`` tokens out of ``argv``.

    Returns ({name: value}, the remaining argv). Flags named in ``keep`` belong to vime itself and stay
    in the remainder. A flag's values are the tokens after it up to the next one starting with ``--``
    (``vime train`` takes no positional arguments, so nothing else can claim them): none makes a bare
    switch (None), one a string, several a list, kept whole in order. ``--flag=value`` is one value.
    """
    forwarded: dict[str, Forwarded] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0]
        if token.startswith("--" + prefix) and name not in keep:
            key = name[len("--" + prefix) :]
            if "=" in token:
                forwarded[key] = token.split("=", 1)[1]
            else:
                values = []
                while i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                    values.append(argv[i + 1])
                    i += 1
                forwarded[key] = None if not values else values[0] if len(values) == 1 else values
        else:
            rest.append(token)
        i += 1
    return forwarded, rest


def to_cli(forwarded: dict[str, Forwarded]) -> list[str]:
    """The flags back as argv tokens: ``--name``, then its value(s)."""
    out: list[str] = []
    for key, value in forwarded.items():
        out.append("--" + key)
        if isinstance(value, list):
            out.extend(str(v) for v in value)
        elif value is not None:
            out.append(value)
    return out
