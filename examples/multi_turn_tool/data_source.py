"""A custom data source (``--data-source-path examples/multi_turn_tool/data_source.py:CalculatorProblems``).

vime data sources are map-style: ``len()`` rows and ``source[i]`` the same prompt every time (the
queue journals row indices, so a resumed run sees exactly the same prompts). Each row here is a
``Sample`` whose ``source`` names the operation ("add" or "mul"): it becomes ``sample.source_name``
and is carried with the sample to training.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from calculator import problem

from vime.sample import Sample


class CalculatorProblems:
    def __init__(self, args):
        self.seed = getattr(args, "seed", 0)
        self.size = 1000

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Sample:
        prompt, label, operation = problem(index, self.seed)
        return Sample(prompt=prompt, label=label, source=operation, metadata={"operation": operation})
