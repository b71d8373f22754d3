"""`python -m specdec.run`: the command-line name kept; the code is :mod:`specdec.experiment.run`."""

from specdec.experiment.run import main

if __name__ == "__main__":
    main()
