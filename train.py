"""`python train.py ARGS` does what `vime train ARGS` does."""

import sys

from vime.train import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
