"""`python -m specdec.replay`: the command-line name kept; the code is :mod:`specdec.experiment.replay`."""

from specdec.experiment.replay import main

if __name__ == "__main__":
    main()
