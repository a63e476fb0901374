"""The ``vime`` command: ``vime train ...``, ``vime tools ...``."""

from __future__ import annotations

import sys

USAGE = """usage: vime <command> [options]

commands:
  train                       run RL training (vime train --help)
  queue inspect|gc|export|retry-failed ...
                              look into a run's durable queue, reclaim, export it, retry failures (vime queue -h)
  engines list|add|remove ... the engines of a running job (vime engines -h)
  tools make-tiny-model OUT   write a tiny random HF model + tokenizer (no download)
  tools convert-hf-to-megatron --hf-checkpoint HF --save OUT [--ckpt-format torch_dist|torch]
  tools convert-megatron-to-hf --load MEGATRON --save OUT --hf-config HF [--ckpt-step N]
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        from vime.train import main as train_main

        return train_main(rest)
    if command == "queue":
        from vime.tools.queue_cli import main as queue_main

        return queue_main(rest)
    if command == "engines":
        from vime.tools.engines_cli import main as engines_main

        return engines_main(rest)
    if command == "tools" and rest and rest[0] == "make-tiny-model":
        from vime.tools.make_tiny_model import main as tiny_main

        return tiny_main(rest[1:]) or 0
    if command == "tools" and rest and rest[0] == "convert-hf-to-megatron":
        from vime.tools.convert_checkpoint import main_hf_to_megatron

        return main_hf_to_megatron(rest[1:])
    if command == "tools" and rest and rest[0] == "convert-megatron-to-hf":
        from vime.tools.convert_checkpoint import main_megatron_to_hf

        return main_megatron_to_hf(rest[1:])
    print(f"vime: unknown command {' '.join(argv[:2])!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
