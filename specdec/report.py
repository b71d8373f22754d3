"""`python -m specdec.report`: the command-line name kept; the code is :mod:`specdec.experiment.report`."""

from specdec.experiment.report import main

if __name__ == "__main__":
    main()
